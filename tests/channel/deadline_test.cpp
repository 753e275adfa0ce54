// Deadlines: a receive gives up when nothing comes, and when a peer sends
// part of a batch and stalls; a send gives up when the peer stops reading.
// A timeout before any byte moved leaves the connection usable, and so does
// a zero timeout (it takes what has come); one that passes while a receive
// waits in the middle of a batch breaks it.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "support/deadlines.h"
#include "support/processes.h"
#include "support/stuck_listener.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;
using clock = std::chrono::steady_clock;

// How late past its deadline a call may return on a loaded machine.
constexpr auto slack = 2s;

TEST(channel_deadline, receive_for_with_nothing_sent_times_out_and_the_connection_stays_usable) {
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  const auto start = clock::now();
  EXPECT_THROW((void)c.receive_for(50ms), timeout_error);
  EXPECT_GE(clock::now() - start, 50ms);
  EXPECT_LT(clock::now() - start, 50ms + slack);
  EXPECT_FALSE(c.broken());

  write_raw(pair.b.get(), raw_batch("SHOL", 2, {{7, bytes_of("late")}}));
  const channel::frame f = c.receive_for(10s);
  EXPECT_EQ(f.type, 7);
  EXPECT_EQ(text_of(f.payload), "late");
}

// The longest durations mean "wait": receive_for(milliseconds::max()) added
// it to the clock in nanoseconds, overflowed into a deadline in the past and
// timed out at once; spins and send timeouts that long are taken too.
TEST(channel_deadline, the_longest_timeouts_and_spins_wait_instead_of_overflowing) {
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  c.set_send_timeout(std::chrono::milliseconds::max());
  auto late = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(100ms);
    write_raw(pair.b.get(), raw_batch("SHOL", 2, {{7, bytes_of("late")}}));
  });
  const channel::frame f = c.receive_for(std::chrono::milliseconds::max());
  EXPECT_EQ(f.type, 7);
  late.get();
  c.set_receive_spin(std::chrono::nanoseconds::max());
  late = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(100ms);
    write_raw(pair.b.get(), raw_batch("SHOL", 2, {{8, bytes_of("later")}}));
  });
  EXPECT_EQ(c.receive_for(std::chrono::milliseconds::max()).type, 8);
  late.get();
}

TEST(channel_deadline, receive_for_zero_takes_what_has_come_and_keeps_a_batch_that_came_in_part) {
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  write_raw(pair.b.get(), raw_batch("SHOL", 2, {{7, bytes_of("there")}}));
  EXPECT_EQ(text_of(c.receive_for(0ms).payload), "there") << "a frame that had come was not read";

  const std::vector<std::byte> batch = raw_batch("SHOL", 2, {{8, bytes_of("halves")}}, 512);
  write_raw(pair.b.get(), {batch.begin(), batch.begin() + 100});
  EXPECT_THROW((void)c.receive_for(0ms), timeout_error);
  EXPECT_FALSE(c.broken()) << "a zero timeout broke a batch still coming";
  write_raw(pair.b.get(), {batch.begin() + 100, batch.end()});
  EXPECT_EQ(text_of(c.receive_for(0ms).payload), "halves");
}

TEST(channel_deadline, a_peer_that_sends_part_of_a_batch_and_stalls_makes_receive_for_time_out_and_breaks_it) {
  const std::vector<std::byte> batch = raw_batch("SHOL", 2, {{1, std::vector<std::byte>(700)}}, 1024);
  for (const std::size_t sent : {std::size_t{8}, std::size_t{300}}) {  // within the header; within the body
    SCOPED_TRACE("the peer sent " + std::to_string(sent) + " of " + std::to_string(batch.size()) + " bytes");
    socket_pair pair;
    connection c = connection::adopt(std::move(pair.a), {});
    write_raw(pair.b.get(), {batch.begin(), batch.begin() + static_cast<std::ptrdiff_t>(sent)});
    const auto start = clock::now();
    returns_within(
        100ms + 2 * slack, [&] { EXPECT_THROW((void)c.receive_for(100ms), timeout_error); },
        [&] { ::shutdown(pair.b.get(), SHUT_RDWR); });
    EXPECT_GE(clock::now() - start, 100ms);
    EXPECT_TRUE(c.broken()) << "the stream is out of step";
    EXPECT_THROW((void)c.receive_for(0ms), connection_closed);
    EXPECT_TRUE(reads_end_of_stream(pair.b.get())) << "the stalled peer sees the connection closed";
  }
}

TEST(channel_deadline, a_send_to_a_peer_that_stops_reading_times_out) {
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  c.set_send_timeout(100ms);
  const std::vector<std::byte> payload(16 * 1024);
  returns_within(
      20s,
      [&] {
        for (int i = 0; i < 100'000; ++i) {  // fills the socket's buffers, which the peer never drains
          const auto start = clock::now();
          try {
            c.send(1, payload);
          } catch (const timeout_error&) {
            EXPECT_LT(clock::now() - start, 100ms + slack);
            EXPECT_GE(clock::now() - start, 100ms);
            return;
          }
        }
        ADD_FAILURE() << "every send went out, though the peer reads nothing";
      },
      [&] { ::shutdown(pair.b.get(), SHUT_RDWR); });
}

TEST(channel_deadline, a_send_that_times_out_before_any_byte_went_leaves_the_connection_usable) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection reader = connection::adopt(std::move(pair.b), {});
  sender.set_send_timeout(50ms);
  // Whole minimum-size batches fill the buffer: a UNIX stream socket takes
  // each such write whole or not at all.
  const std::vector<std::byte> filler = raw_batch("SHOL", 2, {{2, bytes_of("filler")}});
  int fillers = 0;
  while (::send(sender.native_handle(), filler.data(), filler.size(), MSG_DONTWAIT | MSG_NOSIGNAL) ==
         static_cast<ssize_t>(filler.size())) {
    ++fillers;
  }
  ASSERT_GT(fillers, 0);
  returns_within(
      50ms + 2 * slack, [&] { EXPECT_THROW(sender.send(3, bytes_of("too soon")), timeout_error); },
      [&] { ::shutdown(reader.native_handle(), SHUT_RDWR); });
  ASSERT_FALSE(sender.broken());

  for (int i = 0; i < fillers; ++i) ASSERT_EQ(reader.receive_for(10s).type, 2);
  sender.send(3, bytes_of("now"));
  const channel::frame f = reader.receive_for(10s);
  EXPECT_EQ(f.type, 3);
  EXPECT_EQ(text_of(f.payload), "now") << "the stream stayed in step";
}

TEST(channel_deadline, a_receive_for_waiting_behind_another_receive_times_out) {
  socket_pair pair;
  connection c = connection::adopt(std::move(pair.a), {});
  auto blocked = std::async(std::launch::async, [&] { return c.receive_for(10s); });
  // Whichever call takes the lock first, one of them waits behind the other and
  // must give up in time.
  const auto start = clock::now();
  returns_within(
      100ms + 2 * slack, [&] { EXPECT_THROW((void)c.receive_for(100ms), timeout_error); },
      [&] {
        write_raw(pair.b.get(), raw_batch("SHOL", 2, {{5, bytes_of("unblocks")}}));
      });
  EXPECT_LT(clock::now() - start, 100ms + slack);
  write_raw(pair.b.get(), raw_batch("SHOL", 2, {{4, bytes_of("x")}}));
  EXPECT_EQ(blocked.get().type, 4);
}

// A server that stopped accepting, its backlog full: connect gives up at its
// timeout instead of waiting for room for ever.
TEST(channel_deadline, connect_to_a_listener_that_takes_no_one_times_out) {
  temp_dir dir;
  const std::string path = dir / "stuck.sock";
  const stuck_listener server(path);
  const auto start = clock::now();
  returns_within(
      200ms + slack,
      [&] {
        EXPECT_THROW((void)connection::connect(channel::channel_address::at_path(path), {},
                                               connection::default_max_payload, 200ms),
                     timeout_error);
      },
      [&] { server.make_room(); });
  EXPECT_GE(clock::now() - start, 200ms);
}

}  // namespace
}  // namespace shoal::testing
