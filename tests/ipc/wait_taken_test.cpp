// peer::wait_taken: a producer learns when its consumer has taken (mapped,
// or let go) every storage it sent, so it may end without taking them along.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "shoal/ipc/sharing.h"
#include "ipc/captured_exchange.h"
#include "ipc/messages.h"
#include "support/descriptors.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using storage_t = storage::storage;
constexpr std::size_t kib = 1024;

/// A producer on the host backend, and the consumer's end of its connection,
/// made into a peer only when a test asks (consume()).
struct delivery {
  backend::device& dev = backend::host_device_instance();
  alloc::caching_allocator producer_allocator{dev, {}};
  alloc::caching_allocator consumer_allocator{dev, {}};
  ipc::sharing_context producer{producer_allocator, {.collect_interval = std::chrono::milliseconds(0)}};
  ipc::sharing_context consumer{consumer_allocator, {.collect_interval = std::chrono::milliseconds(0)}};
  std::pair<channel::connection, channel::connection> ends = connected_pair();
  ipc::peer sender{producer, std::move(ends.first)};
  std::optional<ipc::peer> receiver;

  ipc::peer& consume() { return receiver.emplace(consumer, std::move(ends.second)); }
  void send() { sender.send(storage_t::allocate(producer_allocator, 8 * kib, {}), {}, {}); }
};

TEST(wait_taken, nothing_sent_is_all_taken_at_once) {
  delivery d;
  EXPECT_EQ(d.sender.wait_taken(0ms), ipc::taken_state::all_taken);
}

TEST(wait_taken, a_storage_counts_as_taken_once_the_consumer_received_it) {
  delivery d;
  d.send();
  d.send();
  const auto started = std::chrono::steady_clock::now();
  EXPECT_EQ(d.sender.wait_taken(30ms), ipc::taken_state::waiting) << "nothing was received";
  EXPECT_GE(std::chrono::steady_clock::now() - started, 30ms);
  ipc::peer& r = d.consume();
  const ipc::received first = r.receive({});
  EXPECT_EQ(d.sender.wait_taken(0ms), ipc::taken_state::waiting) << "one of two was received";
  const ipc::received second = r.receive({});
  EXPECT_EQ(d.sender.wait_taken(0ms), ipc::taken_state::all_taken);
}

TEST(wait_taken, at_most_is_content_with_that_many_untaken) {
  delivery d;
  for (int i = 0; i < 3; ++i) d.send();
  EXPECT_EQ(d.sender.untaken(), 3u);
  EXPECT_EQ(d.sender.wait_taken(0ms, 2), ipc::taken_state::waiting);
  EXPECT_EQ(d.sender.wait_taken(0ms, 3), ipc::taken_state::all_taken);
  const ipc::received first = d.consume().receive({});
  EXPECT_EQ(d.sender.untaken(), 2u);
  EXPECT_EQ(d.sender.wait_taken(0ms, 2), ipc::taken_state::all_taken);
  EXPECT_EQ(d.sender.wait_taken(0ms, 1), ipc::taken_state::waiting);
}

TEST(wait_taken, ends_when_another_thread_receives) {
  delivery d;
  d.send();
  ipc::peer& r = d.consume();
  const auto started = std::chrono::steady_clock::now();
  std::optional<ipc::received> got;  // kept: a storage let go counts as taken too
  std::thread reader([&] {
    std::this_thread::sleep_for(50ms);
    got = r.receive({});
  });
  EXPECT_EQ(d.sender.wait_taken(10s), ipc::taken_state::all_taken);
  const auto waited = std::chrono::steady_clock::now() - started;
  reader.join();
  EXPECT_GE(waited, 40ms);
  EXPECT_LT(waited, 5s);
}

TEST(wait_taken, storages_a_consumer_closed_without_receiving_count_as_taken) {
  delivery d;
  d.send();
  d.consume();
  d.receiver.reset();  // its teardown releases what it never received
  EXPECT_EQ(d.sender.wait_taken(2s), ipc::taken_state::all_taken);
}

TEST(wait_taken, a_consumer_that_hangs_up_holding_a_storage_unreceived_ends_the_wait) {
  delivery d;
  d.send();
  // The consumer's end read raw, as a process that dies would leave it: the
  // storage message read, its reference neither received nor released.
  channel::connection raw = std::move(d.ends.second);
  raw.allow_peer_ring();
  while (raw.receive().type != storage_type) {
  }
  std::thread closer([&] {
    std::this_thread::sleep_for(30ms);
    channel::connection gone = std::move(raw);
  });
  const auto started = std::chrono::steady_clock::now();
  EXPECT_EQ(d.sender.wait_taken(10s), ipc::taken_state::peer_gone);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 5s);
  closer.join();
}

TEST(wait_taken, a_storage_dropped_after_it_was_received_stays_taken) {
  delivery d;
  d.send();
  {
    const ipc::received r = d.consume().receive({});
  }  // released: the slot may be recycled and handed out again
  d.producer.collect();
  ASSERT_EQ(d.producer.stats().held_slots, 0u) << "the slot was recycled";
  d.send();
  EXPECT_EQ(d.sender.wait_taken(0ms), ipc::taken_state::waiting) << "the second storage is not received";
  const ipc::received second = d.receiver->receive({});
  EXPECT_EQ(d.sender.wait_taken(0ms), ipc::taken_state::all_taken);
}

// A consumer that keeps its first reference unreceived and lets every later
// one go must not make the producer keep a record of every send, nor the
// counter file each one is in (a file per send here) open.
TEST(wait_taken, a_first_reference_kept_unreceived_does_not_pin_the_later_ones) {
  backend::device& dev = backend::host_device_instance();
  alloc::caching_allocator allocator{dev, {}};
  ipc::sharing_context producer{allocator, {.collect_interval = 0ms, .slots_per_file = 1}};
  auto [to_consumer, raw] = connected_pair();
  ipc::peer sender(producer, std::move(to_consumer));
  std::map<std::uint64_t, unique_fd> files;  // the counter files the consumer was sent
  const auto send = [&] {
    sender.send(storage_t::allocate(allocator, 4 * kib, {}), {}, {});
    for (;;) {
      channel::frame f = raw.receive();
      if (f.type == counter_file_type) files[ipc::detail::decode_counter_file(f.payload, 1).file_id] = std::move(f.fd);
      if (f.type == storage_type) return ipc::detail::decode_storage(f.payload, {1 << 16, 1 << 12});
    }
  };
  // Released as a holder releases: the slot's word, "released" under its generation.
  const auto release = [&](const ipc::detail::storage_message& m) {
    constexpr std::size_t header_bytes = 64, slot_bytes = 32;
    void* counters = ::mmap(nullptr, header_bytes + slot_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                            files.at(m.file_id).get(), 0);
    ASSERT_NE(counters, MAP_FAILED);
    std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(static_cast<std::byte*>(counters) + header_bytes))
        .store((std::uint64_t{m.slot.generation} << 2) | 2);
    ::munmap(counters, header_bytes + slot_bytes);
    files.erase(m.file_id);
  };
  (void)send();  // never received
  auto previous = send();
  const std::size_t before = open_descriptor_count();
  for (int i = 0; i < 300; ++i) {
    auto next = send();
    release(previous);
    producer.collect();  // recycles the released slot and closes its file
    previous = next;
  }
  // At most the 64 records a sweep waits for, not one per send.
  EXPECT_LT(open_descriptor_count(), before + 70) << "counter files kept open for the sends after the first";
  EXPECT_EQ(sender.wait_taken(0ms), ipc::taken_state::waiting) << "the first is still not received";
}

}  // namespace
}  // namespace shoal::testing
