// Descriptors a peer should not send, and descriptors whose close could hold
// the receiver: refused at the peer's send where the kernel can (SO_PASSRIGHTS,
// Linux 6.16 on), and a peer's socket set to linger closed at once.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;
using channel::listener;

// A TCP socket whose close lingers `seconds`: its peer (`server`, never
// read) advertises no room and data waits in its send buffer.
struct lingering_socket {
  unique_fd listening, server, client;
  explicit lingering_socket(int seconds) {
    listening.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof at;
    const int small = 4096;
    EXPECT_EQ(::setsockopt(listening.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small), 0);
    EXPECT_EQ(::bind(listening.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    EXPECT_EQ(::listen(listening.get(), 1), 0);
    EXPECT_EQ(::getsockname(listening.get(), reinterpret_cast<sockaddr*>(&at), &length), 0);
    client.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    EXPECT_EQ(::setsockopt(client.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
    EXPECT_EQ(::connect(client.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    server.reset(::accept4(listening.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ::fcntl(client.get(), F_SETFL, O_NONBLOCK);
    const std::vector<char> junk(4096);
    while (::send(client.get(), junk.data(), junk.size(), MSG_NOSIGNAL) > 0) {
    }
    const linger on{1, seconds};
    EXPECT_EQ(::setsockopt(client.get(), SOL_SOCKET, SO_LINGER, &on, sizeof on), 0);
  }
};

// A frame that says it carries nothing, with a lingering socket attached: the
// receive refuses the batch and closes the socket (the in-flight message held
// its last reference) at once, not after the peer's 4 s of linger.
TEST(refused_descriptors, a_peers_lingering_socket_is_closed_at_once) {
  socket_pair pair;
  connection victim = connection::adopt(std::move(pair.b), {});
  {
    lingering_socket lingering(4);
    write_raw(pair.a.get(), raw_batch("SHOL", 2, {{1, bytes_of("x"), 0}}), {lingering.client.get()});
    lingering.client.reset();  // the message in flight holds the last reference now
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW((void)victim.receive_for(100ms), protocol_error);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the receive waited out the socket's linger";
  }
}

TEST(refused_descriptors, a_refusing_connection_has_the_kernel_refuse_them_at_the_peers_send) {
  if (!kernel_refuses_descriptors()) GTEST_SKIP() << "this kernel has no SO_PASSRIGHTS (Linux 6.16 on)";
  socket_pair pair;
  connection victim = connection::adopt(std::move(pair.b), {});
  victim.refuse_descriptors();
  pipe_ends pipe;
  const auto batch = raw_batch("SHOL", 2, {{1, bytes_of("with one"), 1}});
  EXPECT_EQ(send_raw(pair.a.get(), batch, {pipe.write.get()}), EPERM) << "the descriptor reached the receiver";
  write_raw(pair.a.get(), raw_batch("SHOL", 2, {{1, bytes_of("without")}}));
  EXPECT_EQ(text_of(victim.receive_for(2s).payload), "without") << "the connection still works";
}

// Set on the listener, the refusal holds from a connection's first byte,
// before the server accepts it.
TEST(refused_descriptors, a_refusing_listener_has_them_refused_before_accept) {
  if (!kernel_refuses_descriptors()) GTEST_SKIP() << "this kernel has no SO_PASSRIGHTS (Linux 6.16 on)";
  const auto where = fresh_abstract_name();
  listener l(where, {});
  l.refuse_descriptors();
  const unique_fd raw = raw_connect(where);
  pipe_ends pipe;
  EXPECT_EQ(send_raw(raw.get(), {std::byte{'S'}}, {pipe.write.get()}), EPERM) << "queued before accept";
  EXPECT_TRUE(l.accept_for(2s).has_value());
}

}  // namespace
}  // namespace shoal::testing
