// Connections: connecting over a path or an abstract name, the peer each
// side sees (in this process and in another), adopting a socket, a peer that
// goes away, and accepting with a deadline.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "shoal/core/process_identity.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::channel_address;
using channel::connection;
using channel::listener;
using shoal::process_identity;

void expect_both_sides_see_this_process(const channel_address& address) {
  listener server(address, {});
  connection client = connection::connect(address, {});
  connection accepted = server.accept();
  const process_identity me = process_identity::self();
  for (const connection* side : {&client, &accepted}) {
    EXPECT_EQ(side->peer().process, me);
    EXPECT_EQ(side->peer().uid, ::geteuid());
    EXPECT_EQ(side->peer().gid, ::getegid());
  }
  client.send(1, bytes_of("ping"));
  const channel::frame ping = accepted.receive();
  EXPECT_EQ(ping.type, 1);
  EXPECT_EQ(text_of(ping.payload), "ping");
  accepted.send(2, bytes_of("pong"));
  EXPECT_EQ(text_of(client.receive().payload), "pong");
}

TEST(channel, connects_over_a_path_and_both_sides_see_their_peer) {
  temp_dir dir;
  expect_both_sides_see_this_process(channel_address::at_path(dir / "sock"));
}

TEST(channel, connects_over_an_abstract_name_and_both_sides_see_their_peer) {
  expect_both_sides_see_this_process(fresh_abstract_name());
}

TEST(channel, the_server_sees_a_client_in_another_process) {
  temp_dir dir;
  const auto address = channel_address::at_path(dir / "sock");
  listener server(address, {});
  const raw_address target = raw_address_of(address);
  forked_child client([&] { return connect_and_hold(target); });
  {
    const connection accepted = server.accept();
    const std::optional<process_identity> expected = shoal::identify_process(client.pid());
    ASSERT_TRUE(expected.has_value());
    EXPECT_EQ(accepted.peer().process, *expected);
    EXPECT_NE(accepted.peer().process, process_identity::self());
    EXPECT_EQ(accepted.peer().uid, ::geteuid());
  }
  EXPECT_EQ(client.wait(), 0);
}

TEST(channel, the_client_sees_a_server_in_another_process) {
  const auto address = fresh_abstract_name();
  const raw_address local = raw_address_of(address);
  pipe_ends ready;
  forked_child server([&] { return listen_and_hold(local, ready.write.get()); });
  char c;
  ASSERT_EQ(::read(ready.read.get(), &c, 1), 1) << "the child listens";
  {
    const connection client = connection::connect(address, {});
    const std::optional<process_identity> expected = shoal::identify_process(server.pid());
    ASSERT_TRUE(expected.has_value());
    EXPECT_EQ(client.peer().process, *expected);
    EXPECT_EQ(client.peer().uid, ::geteuid());
  }
  EXPECT_EQ(server.wait(), 0);
}

TEST(channel, connecting_where_no_one_listens_is_connection_closed) {
  temp_dir dir;
  EXPECT_THROW((void)connection::connect(channel_address::at_path(dir / "nobody-here"), {}), connection_closed);
  EXPECT_THROW((void)connection::connect(fresh_abstract_name(), {}), connection_closed);
  // Told apart by type, not by its text, from a peer that closed a connection.
  try {
    (void)connection::connect(fresh_abstract_name(), {});
  } catch (const connection_closed& e) {
    EXPECT_TRUE(e.no_listener()) << e.what();
  }
}

TEST(channel, adopt_takes_only_a_connected_unix_stream_socket) {
  socket_pair pair;
  const connection adopted = connection::adopt(std::move(pair.a), {});
  EXPECT_EQ(adopted.peer().process, process_identity::self()) << "a socketpair's creator is the peer of both ends";

  EXPECT_THROW((void)connection::adopt(unique_fd(), {}), invalid_argument);
  EXPECT_THROW((void)connection::adopt(unique_fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)), {}),
               invalid_argument);
  int datagram[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, datagram), 0);
  unique_fd datagram_other(datagram[1]);
  EXPECT_THROW((void)connection::adopt(unique_fd(datagram[0]), {}), invalid_argument);
  EXPECT_THROW((void)connection::adopt(unique_fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)), {}),
               invalid_argument)
      << "not connected";
  pipe_ends not_a_socket;
  EXPECT_THROW((void)connection::adopt(std::move(not_a_socket.read), {}), invalid_argument);
}

// A socket handed in non-blocking (asyncio's, a SOCK_NONBLOCK pair) or with
// a send timeout: a send that fills the socket buffer while the peer reads
// slowly waits, instead of failing with EAGAIN and breaking the connection.
TEST(channel, adopt_makes_a_non_blocking_socket_wait_for_a_slow_reader) {
  int ends[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, ends), 0);
  unique_fd sending_end(ends[0]);
  unique_fd reading_end(ends[1]);
  const timeval short_wait{0, 1000};
  ASSERT_EQ(::setsockopt(sending_end.get(), SOL_SOCKET, SO_SNDTIMEO, &short_wait, sizeof short_wait), 0);
  connection sender = connection::adopt(std::move(sending_end), {});
  connection reader = connection::adopt(std::move(reading_end), {});
  const std::string payload(60 * 1024, 'x');
  constexpr int frames = 64;  // about 4 MiB: far past the socket's buffer
  std::thread slow([&] {
    std::this_thread::sleep_for(200ms);
    try {
      for (int i = 0; i < frames; ++i) (void)reader.receive_for(10s);
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the sender's failure is what is checked
    }
  });
  EXPECT_NO_THROW(for (int i = 0; i < frames; ++i) sender.send(1, bytes_of(payload)))
      << "a full buffer broke the connection";
  slow.join();
  EXPECT_FALSE(sender.broken());
}

TEST(channel, a_peer_that_is_gone_gives_connection_closed_not_sigpipe) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  {
    const connection b = connection::adopt(std::move(pair.b), {});
  }
  EXPECT_THROW(a.send(1, bytes_of("late")), connection_closed);
  EXPECT_TRUE(a.broken());
  try {
    (void)a.receive();
    ADD_FAILURE() << "a receive from a peer that is gone returned";
  } catch (const connection_closed& e) {
    EXPECT_FALSE(e.no_listener()) << e.what();
  }
}

TEST(channel, the_peer_closing_is_connection_closed_and_breaks_the_connection) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  pair.b.reset();
  EXPECT_THROW((void)a.receive(), connection_closed);
  EXPECT_TRUE(a.broken());
  EXPECT_THROW(a.send(1, {}), connection_closed);
}

TEST(channel, accept_for_returns_nothing_when_no_one_connects) {
  listener server(fresh_abstract_name(), {});
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(server.accept_for(30ms).has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - start, 30ms);
  EXPECT_FALSE(server.accept_for(0ms).has_value());
  const connection client = connection::connect(server.address(), {});
  EXPECT_TRUE(server.accept_for(1s).has_value());
}

}  // namespace
}  // namespace shoal::testing
