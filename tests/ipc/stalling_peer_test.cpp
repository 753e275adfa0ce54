// Peers that stall: one that sends part of a batch and stops, one that
// stops reading, one that never passes a ready point it sent. Receives and
// sends give up at their deadlines with timeout_error, and tearing a peer
// down waits on the other process for at most sharing_options::teardown_timeout.
#include <gtest/gtest.h>

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "ipc/captured_exchange.h"
#include "shoal/channel/protocol.h"
#include "shoal/ipc/sharing.h"
#include "support/deadlines.h"
#include "support/forwarding_device.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using clock = std::chrono::steady_clock;

// How late past its deadline a call may return on a loaded machine.
constexpr auto slack = 2s;
// sharing_options::teardown_timeout's default.
constexpr auto teardown = 100ms;

// The first 300 bytes of a batch whose header promises 1024.
std::vector<std::byte> part_of_a_batch() {
  std::vector<std::byte> bytes(300);
  const std::uint16_t version = channel::frame_version, frames = 1;
  const std::uint32_t body = 1024 - channel::batch_header_bytes;
  std::memcpy(bytes.data(), "SHOL", 4);
  std::memcpy(bytes.data() + 4, &version, 2);
  std::memcpy(bytes.data() + 6, &frames, 2);
  std::memcpy(bytes.data() + 8, &body, 4);
  return bytes;
}

void send_raw(const channel::connection& to, const std::vector<std::byte>& bytes) {
  ASSERT_EQ(::send(to.native_handle(), bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

// A producer end that said hello and then sent part of a batch, and the consumer's peer.
struct stalled_producer {
  captured_exchange ex;
  std::pair<channel::connection, channel::connection> ends = connected_pair();
  channel::connection& from = ends.first;
  std::unique_ptr<ipc::peer> receiver = std::make_unique<ipc::peer>(ex.consumer, std::move(ends.second));

  explicit stalled_producer(bool malformed_message_first = false) {
    channel::send_hello(from, ipc::sharing_protocol);
    if (malformed_message_first) from.send(999, {});  // no sharing message has that type
    send_raw(from, part_of_a_batch());
  }
  void unblock() { ::shutdown(from.native_handle(), SHUT_RDWR); }
};

TEST(stalling_peer, receive_for_gives_up_on_a_producer_that_stalls_mid_batch) {
  stalled_producer p;
  const auto start = clock::now();
  returns_within(
      100ms + 2 * slack, [&] { EXPECT_THROW((void)p.receiver->receive_for(100ms, {}), timeout_error); },
      [&] { p.unblock(); });
  EXPECT_GE(clock::now() - start, 100ms);
  EXPECT_THROW((void)p.receiver->receive_for(0ms, {}), connection_closed) << "the stream is out of step";
  returns_within(teardown + 2 * slack, [&] { p.receiver.reset(); }, [&] { p.unblock(); });
}

TEST(stalling_peer, receive_for_with_nothing_sent_times_out_and_the_peer_stays_usable) {
  captured_exchange ex;
  auto [from, to] = connected_pair();
  ipc::peer sender(ex.producer, std::move(from));
  ipc::peer receiver(ex.consumer, std::move(to));
  EXPECT_THROW((void)receiver.receive_for(50ms, {}), timeout_error);
  const std::vector<std::byte> note{std::byte{7}};
  sender.send_note(note);
  EXPECT_EQ(receiver.receive_for(10s, {}).metadata, note);
}

TEST(stalling_peer, the_destructor_cuts_off_a_producer_that_stalls_mid_batch) {
  stalled_producer p;  // the consumer never called receive: the part waits unread
  const auto start = clock::now();
  returns_within(teardown + 2 * slack, [&] { p.receiver.reset(); }, [&] { p.unblock(); });
  EXPECT_LT(clock::now() - start, teardown + slack);
}

TEST(stalling_peer, a_protocol_error_followed_by_a_stalled_batch_returns_at_once_and_so_does_the_next_receive) {
  stalled_producer p(true);
  returns_within(
      teardown + 2 * slack, [&] { EXPECT_THROW((void)p.receiver->receive_for(10s, {}), protocol_error); },
      [&] { p.unblock(); });
  const auto start = clock::now();
  EXPECT_THROW((void)p.receiver->receive_for(10s, {}), connection_closed);
  EXPECT_LT(clock::now() - start, slack);
}

// A producer end that said hello and then sends retirements of segments
// that do not exist, batch after batch, until stopped: frames that arrive in
// time but never end a message, faster than they can be read.
struct streaming_producer {
  captured_exchange ex;
  std::pair<channel::connection, channel::connection> ends = connected_pair();
  channel::connection& from = ends.first;
  std::unique_ptr<ipc::peer> receiver = std::make_unique<ipc::peer>(ex.consumer, std::move(ends.second));
  std::atomic<bool> stop{false};
  std::thread writer;

  explicit streaming_producer(bool malformed_message_first = false) {
    channel::send_hello(from, ipc::sharing_protocol);
    if (malformed_message_first) from.send(999, {});
    writer = std::thread([this] {
      // A retire_segments message (type 5): one id, u32 count then u64 ids.
      constexpr std::uint16_t retire_segments = 5;
      const std::uint32_t count = 1;
      const std::uint64_t unknown_id = 1'000'000;
      std::vector<std::byte> payload(sizeof count + sizeof unknown_id);
      std::memcpy(payload.data(), &count, sizeof count);
      std::memcpy(payload.data() + sizeof count, &unknown_id, sizeof unknown_id);
      // Whole batches of them, so the socket stays full: the writer outruns
      // a reader that handles one frame at a time.
      const std::vector<channel::outgoing_frame> batch(channel::max_batch_frames, {retire_segments, payload});
      try {
        while (!stop.load()) from.send(batch);
      } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the consumer closed its end
      }
    });
  }
  ~streaming_producer() {
    stop.store(true);
    unblock();
    writer.join();
  }
  void unblock() { ::shutdown(from.native_handle(), SHUT_RDWR); }
};

TEST(stalling_peer, receive_for_gives_up_on_a_producer_that_streams_frames_but_no_message) {
  streaming_producer p;
  const auto start = clock::now();
  returns_within(
      100ms + 2 * slack, [&] { EXPECT_THROW((void)p.receiver->receive_for(100ms, {}), timeout_error); },
      [&] { p.unblock(); });
  EXPECT_GE(clock::now() - start, 100ms);
  returns_within(teardown + 2 * slack, [&] { p.receiver.reset(); }, [&] { p.unblock(); });
}

TEST(stalling_peer, a_protocol_error_returns_at_once_though_the_producer_keeps_streaming) {
  streaming_producer p(true);
  returns_within(
      teardown + 2 * slack, [&] { EXPECT_THROW((void)p.receiver->receive_for(10s, {}), protocol_error); },
      [&] { p.unblock(); });
}

TEST(stalling_peer, a_send_to_a_consumer_that_stops_reading_times_out) {
  captured_exchange ex;
  ipc::sharing_context producer(ex.producer_allocator, {.collect_interval = 0ms, .send_timeout = 100ms});
  auto [from, to] = connected_pair();  // `to` is never read
  ipc::peer sender(producer, std::move(from));
  const std::vector<std::byte> note(16 * 1024);
  returns_within(
      20s,
      [&] {
        for (int i = 0; i < 100'000; ++i) {
          const auto start = clock::now();
          try {
            sender.send_note(note);
          } catch (const timeout_error&) {
            EXPECT_GE(clock::now() - start, 100ms);
            EXPECT_LT(clock::now() - start, 100ms + slack);
            return;
          }
        }
        ADD_FAILURE() << "every send went out, though the consumer reads nothing";
      },
      [&] { ::shutdown(to.native_handle(), SHUT_RDWR); });
}

TEST(stalling_peer, the_destructor_does_not_wait_for_a_ready_point_the_producer_never_passes) {
  captured_exchange ex;
  backend::device& dev = ex.dev;
  const backend::stream_ref producer_stream = dev.create_stream();
  std::atomic<bool> passes{false};
  dev.host_task(producer_stream, [&passes] {
    while (!passes.load()) std::this_thread::yield();
  });
  auto [from, to] = connected_pair();
  ipc::peer sender(ex.producer, std::move(from));
  auto receiver = std::make_unique<ipc::peer>(ex.consumer, std::move(to));
  sender.send(storage::storage::allocate(ex.producer_allocator, 4096, {}), {}, producer_stream);
  {
    // This thread's stream waits for the producer's point; dropping the
    // storage leaves its release queued behind that wait.
    const ipc::received r = receiver->receive_for(10s, {});
    ASSERT_TRUE(r.storage.valid());
  }
  const auto start = clock::now();
  returns_within(2 * teardown + 2 * slack, [&] { receiver.reset(); }, [&] { passes.store(true); });
  EXPECT_LT(clock::now() - start, 2 * teardown + slack);
  passes.store(true);
  dev.synchronize(producer_stream);
  dev.synchronize({});
  dev.destroy_stream(producer_stream);
}

// A teardown past its deadline leaves the mappings still in use open; once
// the producer passes its point and the releases run, the context's collector
// closes them and gives their counts back (they were counted for the
// process's life: a producer stalling each teardown and reconnecting used up
// max_mapped_bytes for every producer). While they are open, they count
// against the same producer's next connection's own limit.
TEST(stalling_peer, what_a_stalled_teardown_left_open_counts_for_its_producer_and_goes_once_the_stall_ends) {
  ipc::sharing_options options{.collect_interval = 0ms};
  options.max_peer_mapped_bytes = 3u << 20;  // room for one 2 MiB segment mapped
  captured_exchange ex(options);
  backend::device& dev = ex.dev;
  const backend::stream_ref producer_stream = dev.create_stream();
  std::atomic<bool> passes{false};
  dev.host_task(producer_stream, [&passes] {
    while (!passes.load()) std::this_thread::yield();
  });
  auto share_and_tear_down = [&] {
    auto [from, to] = connected_pair();
    ipc::peer sender(ex.producer, std::move(from));
    auto receiver = std::make_unique<ipc::peer>(ex.consumer, std::move(to));
    sender.send(storage::storage::allocate(ex.producer_allocator, 4096, {}), {}, producer_stream);
    { const ipc::received r = receiver->receive_for(10s, {}); }
    receiver.reset();  // past teardown_timeout: the mapping is left open, in use
  };
  share_and_tear_down();
  EXPECT_EQ(ex.consumer.stats().producers_mapped_bytes, 2u << 20) << "left open while in use";
  // The producer connects again while its first mapping is still open: its second one would hold
  // 4 MiB of this producer's mapped, past max_peer_mapped_bytes.
  try {
    share_and_tear_down();
    ADD_FAILURE() << "the mapping a stalled teardown left open did not count for its producer";
  } catch (const protocol_error& e) {
    EXPECT_NE(std::string(e.what()).find("max_peer_mapped_bytes"), std::string::npos) << e.what();
  }
  passes.store(true);
  dev.synchronize(producer_stream);
  dev.synchronize({});
  dev.destroy_stream(producer_stream);
  ex.consumer.collect();
  const auto stats = ex.consumer.stats();
  EXPECT_EQ(stats.producers_mapped_bytes, 0u) << "the mapping left open was not closed once released";
  EXPECT_EQ(stats.producer_resources, 0u) << "the mapping or event source left open stayed counted";
}

// The host device, counting synchronize_device calls.
class device_wait_counting final : public forwarding_device {
 public:
  device_wait_counting() : forwarding_device(backend::host_device_instance()) {}
  void synchronize_device() override {
    ++device_waits;
    forwarding_device::synchronize_device();
  }
  std::atomic<int> device_waits{0};
};

// A received storage used on a stream its user destroyed before dropping it
// (against the rule that a stream outlives its uses): the release waits for
// the whole device, since on CUDA the stream's work runs on after
// cudaStreamDestroy returns; it does not count the stream as passed.
TEST(stalling_peer, a_received_storage_used_on_a_stream_destroyed_first_is_released_after_the_device_is_waited_for) {
  backend::device& dev = backend::host_device_instance();
  device_wait_counting consumer_device;
  alloc::caching_allocator producer_allocator{dev, {}}, consumer_allocator{consumer_device, {}};
  ipc::sharing_context producer{producer_allocator, {.collect_interval = 0ms}},
      consumer{consumer_allocator, {.collect_interval = 0ms}};
  auto [from, to] = connected_pair();
  ipc::peer sender(producer, std::move(from));
  ipc::peer receiver(consumer, std::move(to));
  sender.send(storage::storage::allocate(producer_allocator, 4096, {}), {}, {});
  {
    const ipc::received r = receiver.receive_for(10s, {});
    ASSERT_TRUE(r.storage.valid());
    const backend::stream_ref used = consumer_device.create_stream();
    r.storage.record_stream(used);
    consumer_device.destroy_stream(used);
  }
  EXPECT_GE(consumer_device.device_waits.load(), 1) << "a destroyed stream's uses were taken as passed";
}

TEST(huge_timeouts, saturate_instead_of_expiring_at_once) {
  // milliseconds::max() converted to the clock's nanoseconds overflowed
  // into a deadline in the past: the receive gave up after the hello.
  captured_exchange ex;
  const ipc::sharing_options forever{.collect_interval = 0ms,
                                     .send_timeout = std::chrono::milliseconds::max(),
                                     .teardown_timeout = std::chrono::milliseconds::max()};
  ipc::sharing_context producer(ex.producer_allocator, forever), consumer(ex.consumer_allocator, forever);
  auto [to_consumer, to_producer] = connected_pair();
  ipc::peer sender(producer, std::move(to_consumer));
  auto receiver = std::make_unique<ipc::peer>(consumer, std::move(to_producer));
  const std::vector<std::byte> note{std::byte{42}};
  sender.send_note(note);
  returns_within(slack, [&] {
    ipc::received r;
    ASSERT_NO_THROW(r = receiver->receive_for(std::chrono::milliseconds::max(), {}));
    EXPECT_EQ(r.metadata, note);
  }, [&] { sender.send_note(note); });
  // Teardown reads what has arrived (the unread storage's reference goes
  // back) and returns once nothing more has.
  sender.send(storage::storage::allocate(ex.producer_allocator, 4096, {}), {}, {});
  returns_within(slack, [&] { receiver.reset(); }, [&] { sender.revoke(); });
  producer.collect();
  EXPECT_EQ(producer.stats().held_slots, 0u) << "the storage nobody received was released at teardown";
}

}  // namespace
}  // namespace shoal::testing
