// Descriptors a peer should not send, and descriptors whose close could hold
// the receiver: refused at the peer's send where the kernel can (SO_PASSRIGHTS,
// Linux 6.16 on); otherwise closed on the closer thread, whether the batch is
// refused, the connection closes with them unread, or the listener does
// before accepting theirs.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

#include "channel/channel_fixtures.h"
#include "core/descriptor_closer.h"
#include "support/lingering_socket.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;
using channel::listener;

// A frame that says it carries nothing, with a lingering socket attached: the
// receive refuses the batch at once, and the closer closes the socket (the
// in-flight message held its last reference) with its linger turned off, not
// after the peer's 4 s.
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
    EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(1s)) << "the closer waited out the socket's linger";
  }
}

// A close that waits whatever the receiver does to the descriptor first: it
// happens on the closer thread, and the receive still returns at once.
TEST(refused_descriptors, a_refused_socket_holding_a_lingering_one_is_closed_off_the_receivers_thread) {
  socket_pair pair;
  connection victim = connection::adopt(std::move(pair.b), {});
  socket_holding_a_lingering_one held(2);
  write_raw(pair.a.get(), raw_batch("SHOL", 2, {{1, bytes_of("x"), 0}}), {held.holder.get()});
  held.holder.reset();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)victim.receive_for(100ms), protocol_error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the receive waited out the inner socket's linger";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms) << "the close did not linger: this test shows nothing";
}

// A batch no one read when the connection closes: the close returns at once,
// and the peer sees the hang-up at once too.
TEST(refused_descriptors, a_closing_connection_leaves_a_peers_unread_descriptors_to_the_closer) {
  socket_pair pair;
  auto victim = std::make_unique<connection>(connection::adopt(std::move(pair.b), {}));
  socket_holding_a_lingering_one held(2);
  write_raw(pair.a.get(), raw_batch("SHOL", 2, {{1, bytes_of("x"), 1}}), {held.holder.get()});
  held.holder.reset();
  const auto start = std::chrono::steady_clock::now();
  victim.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the close waited out the inner socket's linger";
  char byte = 0;
  EXPECT_EQ(::read(pair.a.get(), &byte, 1), 0) << "the peer did not see the hang-up";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the peer saw the hang-up only after the linger";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms) << "the close did not linger: this test shows nothing";
}

// A connection the listener never accepted, with descriptors queued on it.
TEST(refused_descriptors, a_closing_listener_leaves_a_waiting_connections_descriptors_to_the_closer) {
  const auto where = fresh_abstract_name();
  auto l = std::make_unique<listener>(where, channel::access_policy{});
  const unique_fd raw = raw_connect(where);
  socket_holding_a_lingering_one held(2);
  write_raw(raw.get(), raw_batch("SHOL", 2, {{1, bytes_of("x"), 1}}), {held.holder.get()});
  held.holder.reset();
  const auto start = std::chrono::steady_clock::now();
  l.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the listener's close waited out the inner socket's linger";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms) << "the close did not linger: this test shows nothing";
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
