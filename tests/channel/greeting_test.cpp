// The socketpair greeting (connection::adopt_pair_end) carries credentials
// only: descriptors sent with it are closed and the greeting refused; the
// wait for it has a deadline.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>

#include <array>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "support/descriptors.h"

namespace shoal::testing {
namespace {

// The other end's greeting, by hand: "SHOLCRED" with its credentials and,
// unasked for, `extra` descriptors.
void send_greeting_with_descriptors(int socket, const std::vector<int>& extra) {
  const int on = 1;
  ASSERT_EQ(::setsockopt(socket, SOL_SOCKET, SO_PASSCRED, &on, sizeof on), 0);
  const ucred mine{::getpid(), ::geteuid(), ::getegid()};
  alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(ucred)) + CMSG_SPACE(sizeof(int) * 8)> control{};
  char text[] = "SHOLCRED";
  iovec part{text, 8};
  msghdr m{};
  m.msg_iov = &part;
  m.msg_iovlen = 1;
  m.msg_control = control.data();
  m.msg_controllen = CMSG_SPACE(sizeof(ucred)) + CMSG_SPACE(sizeof(int) * extra.size());
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_CREDENTIALS;
  c->cmsg_len = CMSG_LEN(sizeof(ucred));
  std::memcpy(CMSG_DATA(c), &mine, sizeof mine);
  c = CMSG_NXTHDR(&m, c);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * extra.size());
  std::memcpy(CMSG_DATA(c), extra.data(), sizeof(int) * extra.size());
  ASSERT_EQ(::sendmsg(socket, &m, MSG_NOSIGNAL), 8);
}

TEST(greeting, descriptors_sent_with_a_greeting_are_closed_and_the_greeting_refused) {
  for (std::size_t count : {1u, 3u, 8u}) {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    unique_fd theirs(fds[1]);
    int pipe_fds[2];
    ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
    unique_fd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
    const std::size_t before = open_descriptor_count();
    std::thread other([&] { send_greeting_with_descriptors(theirs.get(), std::vector<int>(count, read_end.get())); });
    EXPECT_THROW((void)channel::connection::adopt_pair_end(unique_fd(fds[0]), {}), protocol_error) << count << " descriptors";
    other.join();
    theirs.reset();
    EXPECT_EQ(open_descriptor_count(), before - 2) << "every descriptor that came was closed (and both ends of the pair)";
  }
}

// The other end never introduces itself (a process that does not adopt its
// end, or one that sends part of the greeting and stops): the adopting side
// gives up at its timeout, with the socket closed, instead of waiting for ever.
TEST(greeting, an_end_that_never_introduces_itself_times_out) {
  for (const bool in_part : {false, true}) {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    unique_fd theirs(fds[1]);
    if (in_part) ASSERT_EQ(::send(theirs.get(), "SHOL", 4, MSG_NOSIGNAL), 4);
    const std::size_t before = open_descriptor_count();
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW((void)channel::connection::adopt_pair_end(unique_fd(fds[0]), {}, channel::connection::default_max_payload,
                                                           std::chrono::milliseconds(200)),
                 timeout_error)
        << (in_part ? "half a greeting" : "no greeting");
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_GE(waited, std::chrono::milliseconds(200));
    EXPECT_LT(waited, std::chrono::seconds(5));
    EXPECT_EQ(open_descriptor_count(), before - 1) << "the adopting end was closed";
  }
}

// A greeting that comes late, but within the timeout, is taken.
TEST(greeting, a_late_greeting_within_the_timeout_is_taken) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  std::thread other([end = fds[1]] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    (void)channel::connection::adopt_pair_end(unique_fd(end), {});
  });
  const channel::connection c = channel::connection::adopt_pair_end(
      unique_fd(fds[0]), {}, channel::connection::default_max_payload, std::chrono::seconds(10));
  EXPECT_EQ(c.peer().uid, ::geteuid());
  other.join();
}

// A zero timeout still takes a greeting that has come already.
TEST(greeting, a_zero_timeout_takes_a_greeting_that_came_already) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  std::thread other([end = fds[1]] { (void)channel::connection::adopt_pair_end(unique_fd(end), {}); });
  pollfd came{fds[0], POLLIN, 0};
  ASSERT_EQ(::poll(&came, 1, 5000), 1) << "the other end's greeting";
  EXPECT_NO_THROW((void)channel::connection::adopt_pair_end(unique_fd(fds[0]), {},
                                                            channel::connection::default_max_payload,
                                                            std::chrono::milliseconds(0)));
  other.join();
}

}  // namespace
}  // namespace shoal::testing
