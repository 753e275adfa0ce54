// peer::wait_taken: a producer learns when its consumer has taken (mapped,
// or let go) every storage it sent, so it may end without taking them along.
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <thread>
#include <utility>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "shoal/ipc/sharing.h"
#include "ipc/captured_exchange.h"

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
  d.send();
  EXPECT_EQ(d.sender.wait_taken(0ms), ipc::taken_state::waiting) << "the second storage is not received";
  const ipc::received second = d.receiver->receive({});
  EXPECT_EQ(d.sender.wait_taken(0ms), ipc::taken_state::all_taken);
}

}  // namespace
}  // namespace shoal::testing
