// Messages with descriptors over a UNIX socket pair.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "support/descriptors.h"
#include "shoal/core/error.h"
#include "support/fd_transport.h"

namespace shoal::testing {
namespace {

std::vector<std::byte> bytes_of(const char* s) {
  const auto* p = reinterpret_cast<const std::byte*>(s);
  return {p, p + std::strlen(s)};
}

TEST(fd_transport, carries_payload_and_descriptor) {
  socket_pair pair;
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  unique_fd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
  testing::send_message(pair.a.get(), bytes_of("hello"), write_end.get());
  testing::send_message(pair.a.get(), bytes_of(""));
  testing::message first = testing::receive_message(pair.b.get(), 64);
  EXPECT_EQ(first.payload, bytes_of("hello"));
  ASSERT_TRUE(first.fd.valid());
  ASSERT_EQ(::write(first.fd.get(), "x", 1), 1) << "the received descriptor is the pipe's write end";
  char c = 0;
  ASSERT_EQ(::read(read_end.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
  const testing::message second = testing::receive_message(pair.b.get(), 64);
  EXPECT_TRUE(second.payload.empty());
  EXPECT_FALSE(second.fd.valid());
}

TEST(fd_transport, an_oversized_message_is_refused) {
  socket_pair pair;
  testing::send_message(pair.a.get(), std::vector<std::byte>(100));
  EXPECT_THROW((void)testing::receive_message(pair.b.get(), 99), invalid_argument);
}

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(fd_transport, more_than_one_descriptor_is_refused_and_none_leaks) {
  socket_pair pair;
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  unique_fd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
  // A hand-made message carrying two descriptors, as a misbehaving peer would send.
  std::uint32_t length = 0;
  iovec part{&length, sizeof length};
  msghdr header{};
  header.msg_iov = &part;
  header.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))]{};
  header.msg_control = control;
  header.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&header);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(2 * sizeof(int));
  std::memcpy(CMSG_DATA(c), pipe_fds, 2 * sizeof(int));
  ASSERT_EQ(::sendmsg(pair.a.get(), &header, 0), static_cast<ssize_t>(sizeof length));
  // The receiver gets its own two new descriptors: the lowest free numbers.
  const int next_free = ::fcntl(0, F_DUPFD_CLOEXEC, 0);
  ::close(next_free);
  EXPECT_THROW((void)testing::receive_message(pair.b.get(), 64), invalid_argument);
  wait_for_the_closer();  // a peer's descriptors close there
  EXPECT_FALSE(is_open(next_free)) << "a received descriptor was left open";
}

TEST(fd_transport, a_closed_peer_is_reported) {
  socket_pair pair;
  const std::uint16_t half_header = 7;
  ASSERT_EQ(::write(pair.a.get(), &half_header, sizeof half_header), 2);
  pair.a.reset();
  EXPECT_THROW((void)testing::receive_message(pair.b.get(), 64), connection_closed);
  EXPECT_THROW(testing::send_message(pair.b.get(), bytes_of("late")), connection_closed);
}

}  // namespace
}  // namespace shoal::testing
