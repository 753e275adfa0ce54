// Descriptors a peer passed are owned from the moment they are read: a
// refusal of host memory while taking them closes each instead of leaving
// it open and owned by no one.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <new>
#include <vector>

#include "core/descriptor_closer.h"
#include "core/scm_rights.h"
#include "shoal/core/unique_fd.h"
#include "support/processes.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(scm_rights, descriptors_taken_when_host_memory_is_refused_are_closed_not_leaked) {
  pipe_ends a, b, c;
  const std::vector<int> fds{a.read.release(), b.read.release(), c.read.release()};
  std::vector<char> space(CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr header{};
  shoal::detail::attach_descriptors(header, fds, space);
  std::vector<unique_fd> into;
  {
    refusing_one_allocation refuse(1, [] {});  // the room for them
    EXPECT_THROW(shoal::detail::take_descriptors(header, into, unique_fd::no_one_peer), std::bad_alloc);
    EXPECT_TRUE(refuse.refused());
  }
  EXPECT_TRUE(into.empty());
  ASSERT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  for (const int fd : fds) EXPECT_FALSE(is_open(fd)) << "descriptor " << fd << " was left open, owned by no one";
}

}  // namespace
}  // namespace shoal::testing
