// Descriptors a peer should not send, and descriptors whose close could hold
// the receiver: refused at the peer's send where the kernel can (SO_PASSRIGHTS,
// Linux 6.16 on); otherwise closed on the closer thread, whether the batch is
// refused, the connection closes with them unread, or the listener does
// before accepting theirs.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "core/descriptor_closer.h"
#include "support/lingering_socket.h"
#include "support/other_uids.h"
#include "support/refused_allocations.h"
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
  expect_returns_while_the_close_lingers([&] { EXPECT_THROW((void)victim.receive_for(100ms), protocol_error); },
                                         "the receive waited out the inner socket's linger");
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
  // The peer reads end-of-file after the shutdown, or ECONNRESET once the
  // closer has closed the socket with bytes unread (a race either way wins).
  char byte = 0;
  const ssize_t got = ::read(pair.a.get(), &byte, 1);
  EXPECT_TRUE(got == 0 || (got == -1 && errno == ECONNRESET))
      << "the peer did not see the hang-up: " << got << ", " << std::strerror(errno);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the peer saw the hang-up only after the linger";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms) << "the close did not linger: this test shows nothing";
}

// A listener with a connection it never accepted, whose queue holds the last
// reference to a socket whose close lingers 2 s.
struct listener_with_a_lingering_connection_waiting {
  const channel::channel_address where = fresh_abstract_name();
  std::unique_ptr<listener> l = std::make_unique<listener>(where, channel::access_policy{});
  const unique_fd raw = raw_connect(where);
  socket_holding_a_lingering_one held{2};
  listener_with_a_lingering_connection_waiting() {
    write_raw(raw.get(), raw_batch("SHOL", 2, {{1, bytes_of("x"), 1}}), {held.holder.get()});
    held.holder.reset();
  }
};

TEST(refused_descriptors, a_closing_listener_leaves_a_waiting_connections_descriptors_to_the_closer) {
  listener_with_a_lingering_connection_waiting waiting;
  expect_returns_while_the_close_lingers([&] { waiting.l.reset(); },
                                         "the listener's close waited out the inner socket's linger");
}

// The descriptor table full as the listener closes: it cannot accept the
// waiting connection to hand it over, so it hands itself over, and closing it
// (which drops the waiting connection and what is queued on it) lingers on
// the closer, not in the thread that dropped the listener.
TEST(refused_descriptors, a_closing_listener_that_cannot_accept_hands_itself_to_the_closer) {
  listener_with_a_lingering_connection_waiting waiting;
  const int raw = waiting.raw.get();
  // A closer thread already running, as in any process that has handed one
  // over: none is started with the table full, where the sanitizers' own
  // checks of a new thread need a descriptor (a pipe) and report a false
  // invalid object.
  shoal::detail::close_off_thread(::dup(raw));
  ASSERT_TRUE(shoal::detail::off_thread_closes_done_within(1s));
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  const unique_fd lowest_free(::fcntl(raw, F_DUPFD_CLOEXEC, 0));
  low.rlim_cur = std::min<rlim_t>(saved.rlim_cur, static_cast<rlim_t>(lowest_free.get()) + 8);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<unique_fd> filling;  // every number under the limit taken: accept4 fails with EMFILE
  for (unique_fd copy(::dup(raw)); copy; copy.reset(::dup(raw))) filling.push_back(std::move(copy));
  ASSERT_EQ(errno, EMFILE);
  expect_returns_while_the_close_lingers(
      [&] {
        waiting.l.reset();
        filling.clear();
        ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
      },
      "the listener that could not accept closed itself in place");
}

// Out of memory between accept4 and the peer's identification (the fork
// registration, the error text's name of the listener): the accepted
// socket, whose queue may hold the last reference to a peer's lingering
// socket, is closed on the closer like any peer's, not in the accepting
// thread.
TEST(refused_descriptors, an_accept_that_runs_out_of_memory_leaves_the_socket_to_the_closer) {
  const auto where = fresh_abstract_name();
  listener l(where, {});
  for (int nth = 1; nth <= 4; ++nth) {
    SCOPED_TRACE("allocation " + std::to_string(nth));
    const unique_fd raw = raw_connect(where);
    socket_holding_a_lingering_one held(1);
    write_raw(raw.get(), raw_batch("SHOL", 2, {{1, bytes_of("x"), 1}}), {held.holder.get()});
    held.holder.reset();
    const auto start = std::chrono::steady_clock::now();
    bool refused = false;
    try {
      const refusing_one_allocation refusal(nth, [] {});
      (void)l.accept_for(1s);
      refused = refusal.refused();
    } catch (const std::bad_alloc&) {
      refused = true;
    }
    EXPECT_TRUE(refused) << "the accept made fewer allocations than this test refuses";
    EXPECT_LT(std::chrono::steady_clock::now() - start, 500ms) << "the accepted socket was closed in place";
  }
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
}

// However many descriptors one message brings (up to the kernel's 253), the
// read has room for them all: none is closed by the kernel in the reading
// thread, the lingering one last included.
TEST(refused_descriptors, more_descriptors_than_a_batch_takes_are_closed_off_the_readers_thread) {
  for (const std::size_t count : {std::size_t{25}, shoal::detail::max_descriptors_per_message}) {
    SCOPED_TRACE(std::to_string(count) + " descriptors");
    socket_pair pair;
    connection victim = connection::adopt(std::move(pair.b), {});
    pipe_ends pipe;
    socket_holding_a_lingering_one held(2);
    std::vector<int> fds(count - 1, pipe.read.get());
    fds.push_back(held.holder.get());
    write_raw(pair.a.get(), raw_batch("SHOL", 2, {{1, bytes_of("x"), 1}}), fds);
    held.holder.reset();
    expect_returns_while_the_close_lingers([&] { EXPECT_THROW((void)victim.receive_for(100ms), protocol_error); },
                                           "the kernel closed the last ones in the reading thread");
  }
}

// A descriptor sent with an out-of-band byte is read in line and refused,
// not dropped (and closed) by the read that passes the byte.
TEST(refused_descriptors, a_descriptor_sent_out_of_band_is_closed_off_the_readers_thread) {
  socket_pair pair;
  connection victim = connection::adopt(std::move(pair.b), {});
  socket_holding_a_lingering_one held(2);
  write_raw(pair.a.get(), bytes_of("abc"));
  const int oob = send_raw(pair.a.get(), bytes_of("X"), {held.holder.get()}, MSG_OOB);
  if (oob == EOPNOTSUPP) GTEST_SKIP() << "this kernel has no out-of-band data on unix sockets (Linux 5.15 on)";
  ASSERT_EQ(oob, 0) << std::strerror(oob);
  write_raw(pair.a.get(), bytes_of("def, and more than a batch header"));
  held.holder.reset();
  expect_returns_while_the_close_lingers([&] { EXPECT_THROW((void)victim.receive_for(100ms), protocol_error); },
                                         "the read dropped the out-of-band byte's descriptor in place");
}

// A socket pair end whose greeting is refused, with a descriptor queued
// behind it: dropped off the adopting thread.
TEST(refused_descriptors, a_pair_end_refused_at_its_greeting_is_closed_off_the_adopting_thread) {
  socket_pair pair;
  socket_holding_a_lingering_one held(2);
  write_raw(pair.a.get(), bytes_of("NOT A GREETING, NOT AT ALL"));
  write_raw(pair.a.get(), bytes_of("x"), {held.holder.get()});
  held.holder.reset();
  expect_returns_while_the_close_lingers(
      [&] {
        EXPECT_ANY_THROW((void)connection::adopt_pair_end(std::move(pair.b), {}, connection::default_max_payload, 500ms));
      },
      "the adopting thread closed the queued descriptor");
}

// A greeting is refused at the first read that brings a descriptor, not
// after as many reads as its bytes take (each could bring a message's worth).
TEST(refused_descriptors, a_greeting_that_brings_a_descriptor_is_refused_at_that_read) {
  socket_pair pair;
  pipe_ends pipe;
  EXPECT_EQ(send_raw(pair.a.get(), bytes_of("S"), {pipe.read.get()}), 0);  // the rest of the greeting never comes
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)connection::adopt_pair_end(std::move(pair.b), {}, connection::default_max_payload, 2s),
               protocol_error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "the greeting's other reads were waited for";
}

// In a sender child: sends `bytes` on `socket` with two descriptors whose
// closes are held 3 s and `more` others (then `then`, with one more, when
// given), drops its own copies of the held ones (the receiver's are the last
// once it reads), closes `sent`, and keeps the held sockets' other ends open
// until `done` is closed. 0 when it all went.
int send_held_closes_then_wait(int socket, const std::vector<std::byte>& bytes, std::size_t more, pipe_ends& sent,
                               pipe_ends& done, const std::vector<std::byte>& then = {}) {
  socket_holding_a_lingering_one first(3), second(3);
  pipe_ends pipe;
  std::vector<int> fds{first.holder.get(), second.holder.get()};
  fds.insert(fds.end(), more, pipe.read.get());
  if (send_raw(socket, bytes, fds) != 0) return 3;
  if (!then.empty() && send_raw(socket, then, {pipe.read.get()}) != 0) return 4;
  first.holder.reset();
  second.holder.reset();
  sent.write.reset();
  char c;
  (void)::read(done.read.get(), &c, 1);
  return 0;
}

// The descriptors a greeting brings, and the refused socket with what is
// queued on it, are charged to the uid that sent them (the kernel's
// credentials of that message), not to the process that made the pair:
// another uid that holds its closes pauses its own reads only. Its share is
// 8: the 8 waiting behind its 2 held closes reach it, the socket passes it.
TEST(refused_descriptors, a_greetings_descriptors_are_charged_to_the_uid_that_sent_them) {
  if (!may_act_as({65534})) GTEST_SKIP() << "needs root, to send as another uid (mapped here)";
  const lowered_descriptor_limit low(128);
  ASSERT_EQ(shoal::detail::closer_owner_backlog_limit(), 8u);
  socket_pair pair;
  pipe_ends sent, done;
  forked_child sender([&] {
    pair.b.reset();
    sent.read.reset();
    done.write.reset();
    const int switched = become_nobody();
    if (switched != 0) return switched;
    // Then a message left queued, so that the refused socket is not closed in place.
    return send_held_closes_then_wait(pair.a.get(), bytes_of("S"), 8, sent, done, bytes_of("x"));
  });
  pair.a.reset();
  sent.write.reset();
  done.read.reset();
  char c;
  ASSERT_EQ(::read(sent.read.get(), &c, 1), 0) << "the sender did not finish sending";
  EXPECT_THROW((void)connection::adopt_pair_end(std::move(pair.b), {}, connection::default_max_payload, 5s),
               protocol_error);
  std::this_thread::sleep_for(150ms);
  EXPECT_TRUE(shoal::detail::closer_backlogged(nobody)) << "the sender's uid was not charged";
  EXPECT_FALSE(shoal::detail::closer_backlogged(::geteuid())) << "the pair's maker paid for another uid's closes";
  done.write.reset();
  EXPECT_EQ(sender.wait(), 0);
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
}

// The descriptors a connection's batch brings are charged to its peer's uid
// (the kernel's, at the connection): a peer of another uid that holds their
// closes pauses its own connections, not those of this process's uid.
TEST(refused_descriptors, a_connections_descriptors_are_charged_to_its_peers_uid) {
  if (!may_act_as({65534})) GTEST_SKIP() << "needs root, to connect as another uid (mapped here)";
  const lowered_descriptor_limit low(128);
  ASSERT_EQ(shoal::detail::closer_owner_backlog_limit(), 8u);
  const auto address = fresh_abstract_name();
  listener server(address, channel::access_policy{{nobody}});
  const raw_address target = raw_address_of(address);
  pipe_ends sent, done;
  forked_child sender([&] {
    sent.read.reset();
    done.write.reset();
    const int switched = become_nobody();
    if (switched != 0) return switched;
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    // 5: the connect (2 is become_nobody's, 3 and 4 the sends')
    if (s < 0 || ::connect(s, reinterpret_cast<const sockaddr*>(&target.address), target.length) != 0) return 5;
    return send_held_closes_then_wait(s, raw_batch("SHOL", 2, {{1, bytes_of("x"), 14}}), 12, sent, done);
  });
  sent.write.reset();
  done.read.reset();
  char c;
  ASSERT_EQ(::read(sent.read.get(), &c, 1), 0) << "the sender did not finish sending";
  std::optional<connection> accepted = server.accept_for(5s);
  ASSERT_TRUE(accepted.has_value());
  EXPECT_EQ(accepted->peer().uid, nobody);
  try {
    (void)accepted->receive_for(5s);  // a frame carries at most one descriptor: refused, its 14 dropped
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): either way the descriptors went to the closer
  }
  std::this_thread::sleep_for(150ms);
  EXPECT_TRUE(shoal::detail::closer_backlogged(nobody)) << "the peer's uid was not charged";
  EXPECT_FALSE(shoal::detail::closer_backlogged(::geteuid())) << "this process's uid paid for another uid's closes";
  done.write.reset();
  EXPECT_EQ(sender.wait(), 0);
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
}

// A peer of this process's uid holds its closes (the channel charges a
// connection's descriptors to its peer's uid), and more of its descriptors
// wait than its limit: its connections that may take descriptors begin no
// batch (each could install more) until the closes catch up, and then read
// on, unbroken; one that takes none (it installs none) reads on throughout,
// as does a peer of another uid.
TEST(refused_descriptors, while_a_peer_holds_its_closes_its_connections_begin_no_batch_that_may_bring_more) {
  const lowered_descriptor_limit low(128);
  ASSERT_EQ(shoal::detail::closer_owner_backlog_limit(), 8u);
  const auto batch = raw_batch("SHOL", 2, {{1, bytes_of("plain")}});
  // A peer of another uid, connected and with its batch sent before the pause.
  const auto address = fresh_abstract_name();
  std::optional<listener> server;
  std::optional<forked_child> other_uid;
  if (may_act_as({nobody})) {
    server.emplace(address, channel::access_policy{{nobody}});
    const raw_address target = raw_address_of(address);
    other_uid.emplace([&] {
      const int switched = become_nobody();
      if (switched != 0) return switched;
      const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
      if (s < 0 || ::connect(s, reinterpret_cast<const sockaddr*>(&target.address), target.length) != 0) return 3;
      if (::write(s, batch.data(), batch.size()) != static_cast<ssize_t>(batch.size())) return 4;
      char c;
      while (::read(s, &c, 1) > 0) {
      }
      return 0;
    });
  }
  const std::uint32_t own = ::geteuid();
  const auto held = held_closes(own, shoal::detail::max_closes_per_owner, 2);
  pipe_ends pipe;
  for (int i = 0; i < 12; ++i) unique_fd::from_peer(::dup(pipe.read.get()), own).reset();
  std::this_thread::sleep_for(150ms);  // none of its closes has returned for 100 ms: a backlog, not a burst
  EXPECT_TRUE(shoal::detail::closer_backlogged(own));
  socket_pair paused_pair;
  connection paused = connection::adopt(std::move(paused_pair.b), {});
  write_raw(paused_pair.a.get(), batch);
  EXPECT_THROW((void)paused.receive_for(300ms), timeout_error);
  EXPECT_FALSE(paused.try_receive().has_value());
  EXPECT_FALSE(paused.broken()) << "a pause for the closers broke the connection";
  {
    socket_pair pair;
    connection calm = connection::adopt(std::move(pair.b), {});
    calm.refuse_descriptors();
    write_raw(pair.a.get(), batch);
    EXPECT_EQ(text_of(calm.receive_for(1s).payload), "plain") << "a connection that takes no descriptor stopped too";
  }
  if (server) {
    connection other = server->accept();
    EXPECT_EQ(other.peer().uid, nobody);
    EXPECT_EQ(text_of(other.receive_for(1s).payload), "plain") << "a peer of another uid paid for the held closes";
  }
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  EXPECT_FALSE(shoal::detail::closer_backlogged(own));
  EXPECT_EQ(text_of(paused.receive_for(1s).payload), "plain") << "reads did not resume once the closes caught up";
  server.reset();  // the other peer's connection closed: it exits
  if (other_uid) EXPECT_EQ(other_uid->wait(), 0);
}

// A reader already waiting when the hold begins checks it again once bytes
// come: parked in the read itself, it would install a whole message's
// descriptors past the hold.
TEST(refused_descriptors, a_reader_waiting_when_the_closers_hold_new_batches_begins_none_either) {
  const lowered_descriptor_limit low(128);
  const std::uint32_t own = ::geteuid();
  socket_pair pair;
  connection waiting = connection::adopt(std::move(pair.b), {});
  std::atomic<bool> returned{false};
  std::optional<channel::frame> got;
  std::thread reader([&] {
    got = waiting.receive();  // no deadline: once spinning is over, it waits for bytes
    returned = true;
  });
  std::this_thread::sleep_for(100ms);  // waiting for bytes by now
  const auto held = held_closes(own, shoal::detail::max_closes_per_owner, 2);
  pipe_ends pipe;
  for (int i = 0; i < 12; ++i) unique_fd::from_peer(::dup(pipe.read.get()), own).reset();
  std::this_thread::sleep_for(150ms);
  ASSERT_TRUE(shoal::detail::closer_backlogged(own));
  EXPECT_EQ(send_raw(pair.a.get(), raw_batch("SHOL", 2, {{1, bytes_of("with one"), 1}}), {pipe.write.get()}), 0);
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(returned) << "a reader waiting since before the hold read a batch that brought a descriptor";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  reader.join();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(text_of(got->payload), "with one") << "the batch was read once the closes caught up";
}

// A receive held while the closers are behind learns of the peer's hang-up
// at once (nothing left to read): it does not wait for the closes.
TEST(refused_descriptors, a_receive_held_for_the_closers_sees_the_peer_hang_up) {
  const lowered_descriptor_limit low(128);
  const std::uint32_t own = ::geteuid();
  const auto held = held_closes(own, shoal::detail::max_closes_per_owner, 2);
  pipe_ends pipe;
  for (int i = 0; i < 12; ++i) unique_fd::from_peer(::dup(pipe.read.get()), own).reset();
  std::this_thread::sleep_for(150ms);
  ASSERT_TRUE(shoal::detail::closer_backlogged(own));
  for (const bool with_deadline : {false, true}) {
    SCOPED_TRACE(with_deadline ? "receive_for" : "receive");
    socket_pair hanging;
    connection c = connection::adopt(std::move(hanging.b), {});
    std::thread hang_up([&] {
      std::this_thread::sleep_for(100ms);
      hanging.a.reset();
    });
    const auto start = std::chrono::steady_clock::now();
    if (with_deadline) {
      EXPECT_THROW((void)c.receive_for(5s), connection_closed);
    } else {
      EXPECT_THROW((void)c.receive(), connection_closed);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 600ms) << "the receive waited for the closes";
    hang_up.join();
  }
  EXPECT_TRUE(shoal::detail::closer_backlogged(own)) << "the closes were done before the receives: this test shows nothing";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
}

// A peer that sent a whole batch and hung up: the held receive waits for the
// closes and then reads the batch (its bytes were still queued), even with
// SO_PEEK_OFF set on the socket, where each peek would move on by a byte.
TEST(refused_descriptors, a_receive_held_for_the_closers_reads_what_a_peer_sent_before_it_hung_up) {
  const lowered_descriptor_limit low(128);
  const std::uint32_t own = ::geteuid();
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.b), {});
  const int peek_from = 0;
  ASSERT_EQ(::setsockopt(c.native_handle(), SOL_SOCKET, SO_PEEK_OFF, &peek_from, sizeof peek_from), 0);
  const auto held = held_closes(own, shoal::detail::max_closes_per_owner, 2);
  pipe_ends pipe;
  for (int i = 0; i < 12; ++i) unique_fd::from_peer(::dup(pipe.read.get()), own).reset();
  std::this_thread::sleep_for(150ms);
  ASSERT_TRUE(shoal::detail::closer_backlogged(own));
  write_raw(pair.a.get(), raw_batch("SHOL", 2, {{1, bytes_of("sent before the hang-up")}}));
  pair.a.reset();
  EXPECT_EQ(text_of(c.receive_for(10s).payload), "sent before the hang-up");
  EXPECT_FALSE(shoal::detail::closer_backlogged(own)) << "read before the closes caught up";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
}

// While more than twice the process-wide limit of peers' descriptors wait
// to be closed, listeners accept no connection (one refused at its accept
// brings its queued descriptors along: peers of uids the policy refuses
// could fill the table by connecting again and again); the connections wait
// in the kernel's queue and are accepted once the closes catch up.
TEST(refused_descriptors, while_the_closers_are_far_behind_listeners_accept_no_connection) {
  const lowered_descriptor_limit low(128);
  const std::size_t limit = shoal::detail::closer_backlog_limit();
  ASSERT_EQ(limit, 32u);
  const auto address = fresh_abstract_name();
  listener server(address, {});
  const auto held = held_closes(nobody, shoal::detail::max_closes_per_owner, 2);
  pipe_ends pipe;
  for (std::size_t i = 0; i < 2 * limit; ++i) unique_fd::from_peer(::dup(pipe.read.get()), nobody).reset();
  EXPECT_FALSE(shoal::detail::closer_holds_accepts()) << "held at twice the limit, not past it";
  unique_fd::from_peer(::dup(pipe.read.get()), nobody).reset();
  const connection client = connection::connect(address, {});
  EXPECT_FALSE(server.accept_for(300ms).has_value()) << "a connection was accepted while the closers were far behind";
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(30s));
  EXPECT_TRUE(server.accept_for(1s).has_value()) << "accepts did not resume once the closes caught up";
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

// A connection's two ends, the receiving one refusing descriptors, and a
// descriptor to send: the sender's side of a refusal.
struct refusing_pair {
  refusing_pair() {
    socket_pair pair;
    sender = connection::adopt(std::move(pair.a), {});
    victim = connection::adopt(std::move(pair.b), {});
    victim->refuse_descriptors();
  }
  std::optional<connection> sender;
  std::optional<connection> victim;
  pipe_ends pipe;
};

// The sender's side of the same refusal: a typed error that says what
// happened, and a stream still in step when nothing of the call went.
TEST(refused_descriptors, a_send_of_a_descriptor_to_a_refusing_peer_is_a_protocol_error_and_the_connection_goes_on) {
  if (!kernel_refuses_descriptors()) GTEST_SKIP() << "this kernel has no SO_PASSRIGHTS (Linux 6.16 on)";
  refusing_pair ends;
  connection& sender = *ends.sender;
  try {
    sender.send(1, bytes_of("with one"), ends.pipe.write.get());
    ADD_FAILURE() << "the send of a descriptor to a refusing peer went";
  } catch (const protocol_error& e) {
    EXPECT_NE(std::string(e.what()).find("takes no descriptors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("stays usable"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)sender.start_ring(4096), protocol_error) << "a ring's files are descriptors too";
  sender.send(1, bytes_of("without"));
  EXPECT_EQ(text_of(ends.victim->receive_for(2s).payload), "without") << "the refused send left the stream out of step";
}

// A refusal after an earlier batch of the same call went leaves half of it
// with the peer: the connection is closed.
TEST(refused_descriptors, a_refusal_after_part_of_a_send_went_closes_the_connection) {
  if (!kernel_refuses_descriptors()) GTEST_SKIP() << "this kernel has no SO_PASSRIGHTS (Linux 6.16 on)";
  refusing_pair ends;
  std::vector<channel::outgoing_frame> frames(channel::max_batch_frames, channel::outgoing_frame{1, {}, -1});
  frames.push_back({1, {}, ends.pipe.write.get()});  // the second batch's only frame
  EXPECT_THROW(ends.sender->send(frames), protocol_error);
  EXPECT_THROW(ends.sender->send(1, bytes_of("after")), connection_closed) << "a stream out of step stayed usable";
}

// post() queues what the socket does not take: a refusal met there, or by a
// later flush(), may follow frames that went, so it closes the connection,
// saying which call and peer it was.
TEST(refused_descriptors, a_posted_descriptor_to_a_refusing_peer_closes_the_connection_and_says_so) {
  if (!kernel_refuses_descriptors()) GTEST_SKIP() << "this kernel has no SO_PASSRIGHTS (Linux 6.16 on)";
  refusing_pair ends;
  try {
    ends.sender->post(1, bytes_of("with one"), ends.pipe.write.get());
    (void)ends.sender->flush();
    ADD_FAILURE() << "a posted descriptor went to a refusing peer";
  } catch (const protocol_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("connection::post to pid " + std::to_string(::getpid())), std::string::npos) << what;
    EXPECT_NE(what.find("takes no descriptors"), std::string::npos) << what;
    EXPECT_NE(what.find("the connection is closed"), std::string::npos) << what;
  }
  EXPECT_THROW(ends.sender->post(1, bytes_of("after")), connection_closed);
}

}  // namespace
}  // namespace shoal::testing
