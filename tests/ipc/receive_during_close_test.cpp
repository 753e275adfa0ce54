// The consumer's collector closes retired mappings without the receiver's
// lock, so a receive never waits behind the collector's closes
// (docs/architecture.md). Here the consumer's device holds every close until
// the test lets it go, and a receive must complete while one is held.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "shoal/backend/devices.h"
#include "shoal/ipc/sharing.h"
#include "support/descriptors.h"
#include "support/forwarding_device.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using storage_t = storage::storage;
constexpr std::size_t small_storage_bytes = 4096;  // small blocks of one producer segment share its mapping

/// The host device, except that close_import waits until open() is called.
class held_close_device final : public forwarding_device {
 public:
  held_close_device() : forwarding_device(backend::host_device_instance()) {}

  void close_import(void* ptr) override {
    {
      std::unique_lock lock(mutex_);
      ++closes_started_;
      changed_.notify_all();
      changed_.wait(lock, [this] { return open_; });
    }
    forwarding_device::close_import(ptr);
  }
  /// Lets every close, held or to come, go through.
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    changed_.notify_all();
  }
  /// True once a close has started, within `limit`.
  bool close_started_within(std::chrono::milliseconds limit) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, limit, [this] { return closes_started_ > 0; });
  }
  int closes_started() {
    std::lock_guard lock(mutex_);
    return closes_started_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = false;       // guarded by mutex_
  int closes_started_ = 0;  // guarded by mutex_
};

/// Opens the device's closes when the test leaves, however it leaves, so no
/// held close outlives it.
struct opens_on_exit {
  held_close_device& device;
  ~opens_on_exit() { device.open(); }
};

TEST(receive_during_close, a_receive_completes_while_the_collector_closes_a_retired_mapping) {
  held_close_device consumer_device;
  alloc::caching_allocator producer_allocator(backend::host_device_instance(), {});
  alloc::caching_allocator consumer_allocator(consumer_device, {});
  ipc::sharing_context producer(producer_allocator, {.collect_interval = 0ms});
  ipc::sharing_context consumer(consumer_allocator, {.collect_interval = 0ms});
  socket_pair ends;
  ipc::peer to_consumer(producer, channel::connection::adopt(std::move(ends.a), {}));
  ipc::peer from_producer(consumer, channel::connection::adopt(std::move(ends.b), {}));

  // Storage A: received and dropped, its block freed and its segment given
  // back to the device, so the producer retires the segment.
  to_consumer.send(storage_t::allocate(producer_allocator, small_storage_bytes, {}), {}, {});
  ASSERT_TRUE(from_producer.receive({}).storage.valid());
  consumer_device.synchronize({});  // the dropped storage's release has run
  producer.collect();
  producer_allocator.empty_cache();
  ASSERT_EQ(producer.stats().exported_segments, 0u);

  // Storage B, on a new segment: its receive takes in the retirement first.
  to_consumer.send(storage_t::allocate(producer_allocator, small_storage_bytes, {}), {}, {});
  const ipc::received b = from_producer.receive({});
  ASSERT_TRUE(b.storage.valid());
  ASSERT_EQ(from_producer.stats().open_mappings, 2u) << "B's, and A's retired one waiting for the collector";

  // In this order so that on any exit the held close is let go first, then
  // the receive and the collector finish.
  std::jthread collector;
  std::future<ipc::received> receiving;
  const opens_on_exit release_held_closes{consumer_device};
  collector = std::jthread([&] { consumer.collect(); });
  ASSERT_TRUE(consumer_device.close_started_within(5s)) << "the collector never closed A's mapping";

  // Storage C while A's close is held: the receive must not wait for it.
  to_consumer.send(storage_t::allocate(producer_allocator, small_storage_bytes, {}), {}, {});
  receiving = std::async(std::launch::async, [&] { return from_producer.receive({}); });
  ASSERT_TRUE(receiving.wait_for(5s) == std::future_status::ready) << "receive waited behind the collector's close";
  const ipc::received c = receiving.get();
  EXPECT_TRUE(c.storage.valid());

  consumer_device.open();
  collector.join();
  EXPECT_EQ(consumer_device.closes_started(), 1);
  EXPECT_EQ(from_producer.stats().open_mappings, 1u) << "A's mapping is closed; B and C share one";
}

}  // namespace
}  // namespace shoal::testing
