// Frames and the batches they travel in: type, payload and descriptor, the
// documented wire layout, order, packing limits, partial reads, the spinning
// receive, and senders on many threads.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "channel/channel_fixtures.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using channel::connection;

TEST(channel, a_frame_carries_its_type_payload_and_descriptor) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {}, 16);
  connection b = connection::adopt(std::move(pair.b), {}, 16);
  pipe_ends pipe;
  a.send(7, bytes_of("hello"), pipe.write.get());
  a.send(0xffff, {});
  a.send(3, std::vector<std::byte>(16, std::byte{0x5a}));

  channel::frame first = b.receive();
  EXPECT_EQ(first.type, 7);
  EXPECT_EQ(text_of(first.payload), "hello");
  ASSERT_TRUE(first.fd.valid());
  ASSERT_EQ(::write(first.fd.get(), "x", 1), 1) << "the received descriptor is the pipe's write end";
  char c = 0;
  ASSERT_EQ(::read(pipe.read.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
  const channel::frame empty = b.receive();
  EXPECT_EQ(empty.type, 0xffff);
  EXPECT_TRUE(empty.payload.empty());
  EXPECT_FALSE(empty.fd.valid());
  EXPECT_EQ(b.receive().payload, std::vector<std::byte>(16, std::byte{0x5a})) << "exactly max_payload is allowed";
  EXPECT_FALSE(b.broken());

  EXPECT_THROW(a.send(1, {}, 12345), invalid_argument) << "not an open descriptor";
  EXPECT_FALSE(a.broken()) << "nothing was sent, so the stream is still in step";
}

TEST(channel, a_frame_is_laid_out_as_documented) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  sender.send(0x1234, bytes_of("ab"));
  const auto xyz = bytes_of("xyz");
  const std::vector<channel::outgoing_frame> two = {{7, xyz}, {8, {}}};
  sender.send(two);
  std::vector<std::byte> wire(2 * 256);
  ASSERT_EQ(::recv(pair.b.get(), wire.data(), wire.size(), MSG_WAITALL), static_cast<ssize_t>(wire.size()));
  EXPECT_EQ(std::vector(wire.begin(), wire.begin() + 256), raw_batch("SHOL", 2, {{0x1234, bytes_of("ab")}}));
  EXPECT_EQ(std::vector(wire.begin() + 256, wire.end()), raw_batch("SHOL", 2, {{7, bytes_of("xyz")}, {8, {}}}))
      << "frames sent together share one padded batch";
  EXPECT_EQ(::recv(pair.b.get(), wire.data(), 1, MSG_DONTWAIT), -1) << "nothing else was sent";
}

TEST(channel, frames_sent_together_arrive_in_order_with_their_descriptors) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  // 100 frames, 20 of them with a descriptor: more than one batch may hold.
  std::vector<pipe_ends> pipes(20);
  std::vector<std::vector<std::byte>> payloads;
  for (int i = 0; i < 100; ++i) payloads.push_back(bytes_of("frame " + std::to_string(i)));
  std::vector<channel::outgoing_frame> frames;
  for (int i = 0; i < 100; ++i) {
    frames.push_back({static_cast<std::uint16_t>(i), payloads[i], i % 5 == 0 ? pipes[i / 5].write.get() : -1});
  }
  a.send(frames);
  for (int i = 0; i < 100; ++i) {
    SCOPED_TRACE(i);
    const channel::frame f = b.receive();
    ASSERT_EQ(f.type, i);
    EXPECT_EQ(text_of(f.payload), "frame " + std::to_string(i));
    ASSERT_EQ(f.fd.valid(), i % 5 == 0);
    if (f.fd.valid()) {
      ASSERT_EQ(::write(f.fd.get(), "x", 1), 1);
      char c = 0;
      EXPECT_EQ(::read(pipes[i / 5].read.get(), &c, 1), 1) << "the descriptor is its own frame's pipe";
    }
  }
  EXPECT_EQ(b.pending(), 0U);
}

TEST(channel, frames_past_the_packing_limit_go_in_separate_batches) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  const std::vector<std::byte> big(channel::batch_packing_bytes / 2 + 1, std::byte{7});
  const std::vector<channel::outgoing_frame> two = {{1, big}, {2, big}};
  sender.send(two);
  // Read raw: a batch header, then its frames; each batch here holds one.
  for (std::uint16_t type = 1; type <= 2; ++type) {
    std::vector<std::byte> header(12 + 8);
    ASSERT_EQ(::recv(pair.b.get(), header.data(), header.size(), MSG_WAITALL), static_cast<ssize_t>(header.size()));
    std::uint16_t frames = 0, first_type = 0;
    std::memcpy(&frames, header.data() + 6, 2);
    std::memcpy(&first_type, header.data() + 12, 2);
    EXPECT_EQ(frames, 1) << "two payloads over the packing limit together do not share a batch";
    EXPECT_EQ(first_type, type);
    std::vector<std::byte> rest(big.size());
    ASSERT_EQ(::recv(pair.b.get(), rest.data(), rest.size(), MSG_WAITALL), static_cast<ssize_t>(rest.size()));
  }
}

TEST(channel, frames_with_a_closed_descriptor_are_not_sent_at_all) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  pipe_ends pipe;
  int closed_fd = ::dup(pipe.write.get());
  ::close(closed_fd);
  const auto payload = bytes_of("x");
  const std::vector<channel::outgoing_frame> three = {{1, payload}, {2, payload, pipe.write.get()}, {3, payload, closed_fd}};
  EXPECT_THROW(a.send(three), invalid_argument);
  EXPECT_FALSE(a.broken()) << "nothing was sent, so the stream is still in step";
  pollfd waiting{b.native_handle(), POLLIN, 0};
  EXPECT_EQ(::poll(&waiting, 1, 0), 0) << "not even the frames before the bad one went out";
  a.send(4, payload);
  EXPECT_EQ(b.receive().type, 4);
}

TEST(channel, a_batch_is_read_whole_and_never_past_its_end) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  const auto abc = bytes_of("abc");
  const std::vector<channel::outgoing_frame> three = {{1, std::span(abc).first(1)}, {2, std::span(abc).subspan(1, 1)},
                                                  {3, std::span(abc).subspan(2)}};
  a.send(three);
  a.send(4, bytes_of("next batch"));
  const auto readable = [&] {
    pollfd waiting{b.native_handle(), POLLIN, 0};
    return ::poll(&waiting, 1, 0) == 1;
  };
  EXPECT_EQ(b.receive().type, 1);
  EXPECT_EQ(b.pending(), 2U) << "the batch's other frames came with it";
  EXPECT_TRUE(readable()) << "the next batch is still in the socket";
  EXPECT_EQ(b.receive().type, 2);
  EXPECT_EQ(b.receive().type, 3);
  EXPECT_EQ(b.pending(), 0U);
  EXPECT_EQ(text_of(b.receive().payload), "next batch");
  EXPECT_FALSE(readable()) << "nothing is left once every batch is read";
}

TEST(channel, a_spinning_receive_takes_what_comes_during_the_spin_and_blocks_after_it) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  // Arrives while the receiver still spins (a 2 s spin; sent after 20 ms).
  b.set_receive_spin(2s);
  std::thread early([&] {
    std::this_thread::sleep_for(20ms);
    a.send(1, bytes_of("early"));
  });
  EXPECT_EQ(text_of(b.receive().payload), "early");
  early.join();
  // Arrives long after a 1 ms spin: the receive blocks and still gets it, with
  // its descriptor, and the socket stays a blocking one.
  b.set_receive_spin(1ms);
  pipe_ends pipe;
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    a.send(2, bytes_of("late"), pipe.write.get());
  });
  const auto start = std::chrono::steady_clock::now();
  const std::chrono::nanoseconds cpu_before = thread_cpu_time();
  const channel::frame f = b.receive();
  EXPECT_GE(std::chrono::steady_clock::now() - start, 150ms) << "returned before the frame was sent";
  EXPECT_LT(thread_cpu_time() - cpu_before, 50ms) << "it kept spinning instead of blocking";
  EXPECT_EQ(text_of(f.payload), "late");
  EXPECT_TRUE(f.fd.valid());
  late.join();
  EXPECT_EQ(::fcntl(b.native_handle(), F_GETFL) & O_NONBLOCK, 0);
}

TEST(channel, pending_answers_while_another_thread_waits_in_receive) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {});
  connection b = connection::adopt(std::move(pair.b), {});
  std::thread waiting([&] { EXPECT_EQ(b.receive().type, 5); });
  std::this_thread::sleep_for(50ms);  // the receive is blocked by now
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(b.pending(), 0U);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "pending() waited for the blocked receive";
  a.send(5, {});
  waiting.join();
}

TEST(channel, the_largest_max_payload_still_takes_ordinary_frames) {
  socket_pair pair;
  connection a = connection::adopt(std::move(pair.a), {}, SIZE_MAX);
  connection b = connection::adopt(std::move(pair.b), {}, SIZE_MAX);
  a.send(1, std::vector<std::byte>(100000, std::byte{3}));
  EXPECT_EQ(b.receive().payload.size(), 100000U);
}

TEST(channel, frames_sent_from_many_threads_arrive_whole) {
  socket_pair pair;
  connection sender = connection::adopt(std::move(pair.a), {});
  connection receiver = connection::adopt(std::move(pair.b), {});
  constexpr std::uint16_t threads = 4;
  constexpr std::uint32_t frames_each = 300;
  const auto payload_size = [](std::uint32_t i) { return std::size_t{4} + (i * 37) % 3000; };
  const auto fill = [](std::uint16_t t, std::uint32_t i) { return static_cast<std::byte>(t * 16 + i % 16); };
  std::vector<std::thread> senders;
  for (std::uint16_t t = 0; t < threads; ++t) {
    senders.emplace_back([&, t] {
      try {
        for (std::uint32_t i = 0; i < frames_each; ++i) {
          std::vector<std::byte> payload(payload_size(i), fill(t, i));
          std::memcpy(payload.data(), &i, 4);
          sender.send(t, payload);
        }
      } catch (const connection_closed&) {  // the receiver gave up; it reports why
      }
    });
  }
  const auto receive_all = [&]() -> ::testing::AssertionResult {
    std::vector<std::uint32_t> next(threads, 0);
    for (std::uint32_t n = 0; n < threads * frames_each; ++n) {
      const channel::frame f = receiver.receive();
      if (f.type >= threads || f.payload.size() < 4) return ::testing::AssertionFailure() << "a foreign frame";
      std::uint32_t i;
      std::memcpy(&i, f.payload.data(), 4);
      if (i != next[f.type]++) return ::testing::AssertionFailure() << "thread " << f.type << "'s frames out of order";
      if (f.payload.size() != payload_size(i)) return ::testing::AssertionFailure() << "a frame of the wrong size";
      for (std::size_t k = 4; k < f.payload.size(); ++k) {
        if (f.payload[k] != fill(f.type, i)) return ::testing::AssertionFailure() << "frames interleaved";
      }
    }
    return ::testing::AssertionSuccess();
  };
  const ::testing::AssertionResult received = receive_all();
  if (!received) ::shutdown(receiver.native_handle(), SHUT_RDWR);  // unblock the senders
  for (auto& s : senders) s.join();
  EXPECT_TRUE(received);
}

}  // namespace
}  // namespace shoal::testing
