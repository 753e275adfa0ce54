// Failures that strike a whole group of coalesced batches, or every batch
// with a buffer in one packed copy (transfer_engine.h, Errors): each such
// batch fails with the device's typed error, the others of the group arrive
// whole, nothing stays allocated, and the engine goes on serving.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/transfer/transfer_engine.h"
#include "support/backends.h"
#include "support/forwarding_device.h"
#include "support/host_buffers.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using transfer::host_buffer;
using transfer::transfer_config;
using transfer::transfer_engine;
constexpr std::size_t kib = 1024;
constexpr std::size_t holder_bytes = 4 * kib;  // the copy that holds the engine's thread

// Holds the engine's thread in the copy of the holder's buffer until the
// test lets it go (so the batches submitted meanwhile queue up and are taken
// as one group), and fails what the test tells it to: copies the predicate
// names, and the event records of the engine's thread (the one that copied
// the holder) once `records_fail` is set.
class failing_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;

  void copy(backend::stream_ref s, void* dst, const void* src, std::size_t bytes) override {
    if (bytes == holder_bytes) hold();
    if (copy_fails && copy_fails(bytes)) throw backend_error("copy", "refused by the test");
    if (bytes == arm_records_at_copy_of) {  // once
      arm_records_at_copy_of = 0;
      records_fail = true;
    }
    forwarding_device::copy(s, dst, src, bytes);
  }
  void record(backend::event_ref event, backend::stream_ref s) override {
    if (records_fail && std::this_thread::get_id() == engine_thread_) {
      throw backend_error("event record", "refused by the test");
    }
    forwarding_device::record(event, s);
  }

  /// Waits (10 s at most) until the engine's thread is in the holder's copy.
  void wait_until_held() {
    std::unique_lock lock(mutex_);
    ASSERT_TRUE(changed_.wait_for(lock, 10s, [&] { return holding_; })) << "the engine never copied the holder";
  }
  void let_go() {
    {
      std::lock_guard lock(mutex_);
      released_ = true;
    }
    changed_.notify_all();
  }

  std::function<bool(std::size_t)> copy_fails;  // set before the engine starts
  std::size_t arm_records_at_copy_of = 0;      // set before the engine starts; its copies alone touch it
  std::atomic<bool> records_fail{false};

 private:
  void hold() {
    std::unique_lock lock(mutex_);
    engine_thread_ = std::this_thread::get_id();
    holding_ = true;
    changed_.notify_all();
    changed_.wait_for(lock, 10s, [&] { return released_; });  // a test that never lets go still ends
  }
  std::mutex mutex_;
  std::condition_variable changed_;
  bool holding_ = false;   // guarded by mutex_
  bool released_ = false;  // guarded by mutex_
  std::thread::id engine_thread_;  // set while holding, before records_fail can be set
};

template <class Backend>
class transfer_engine_group_failures : public backend_test<Backend> {
 public:
  // A pinned host buffer of `bytes`, each `value`, whose release sets `*released`.
  host_buffer pinned(std::size_t bytes, std::uint8_t value, std::atomic<bool>* released = nullptr) {
    backend::device& dev = this->device();
    void* p = dev.allocate_pinned_host(bytes);
    std::memset(p, value, bytes);
    auto keep = std::shared_ptr<void>(p, [&dev, released](void* q) {
      dev.free_pinned_host(q);
      if (released != nullptr) *released = true;
    });
    return host_buffer{p, bytes, true, std::move(keep)};
  }
  /// The bytes of `batch`'s first storage, read on `s` (which must outlive
  /// the batch's free: the read is recorded on its storages).
  std::vector<std::uint8_t> read(const transfer::transferred_batch& batch, std::size_t bytes, backend::stream_ref s) {
    batch.wait_on(s);
    std::vector<std::uint8_t> out(bytes);
    this->device().copy(s, out.data(), batch.storages()[0].data(), bytes);
    this->device().synchronize(s);
    return out;
  }
};
TYPED_TEST_SUITE(transfer_engine_group_failures, backend_types, backend_names);

template <class Predicate>
bool eventually(Predicate done) {
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// Without the engine's catch around the group's event record, the error
// would leave the engine's thread (noexcept) and end the process.
TYPED_TEST(transfer_engine_group_failures, a_group_whose_ready_event_cannot_be_recorded_fails_every_batch_of_it) {
  failing_device dev(this->device());
  dev.arm_records_at_copy_of = 8 * kib;  // the group's first copy; the holder's record still succeeds
  stream copy_stream(dev), consumer(dev);  // made before the allocator, gone after it
  alloc::caching_allocator a(dev);
  std::array<std::atomic<bool>, 3> released{};
  {
    transfer_engine engine(a, copy_stream.ref());
    engine.submit({this->pinned(holder_bytes, 0x11)});
    dev.wait_until_held();
    for (std::size_t i = 0; i < 3; ++i) {
      engine.submit({this->pinned(8 * kib, static_cast<std::uint8_t>(0x20 + i), &released[i])});
    }
    dev.let_go();
    const auto holder = engine.next(10s);
    EXPECT_TRUE(all_equal(this->read(holder, holder_bytes, consumer), 0x11));
    for (std::size_t i = 0; i < 3; ++i) {
      try {
        (void)engine.next(10s);
        ADD_FAILURE() << "batch " << i + 1 << " arrived though its group's ready event was never recorded";
      } catch (const backend_error& e) {
        EXPECT_EQ(e.call(), "event record");
      }
    }
    auto s = engine.stats();
    EXPECT_EQ(s.coalesced_groups, 2u) << "the holder, then the three as one group";
    EXPECT_EQ(s.batches_failed, 3u);
    EXPECT_EQ(s.in_flight, 0u);
    EXPECT_TRUE(eventually([&] { return released[0] && released[1] && released[2]; }))
        << "the failed batches' pinned sources were let go once their copies had run";
    EXPECT_EQ(a.stats().allocations.aggregate.current, 1) << "the holder's block alone: the failed group's was freed";

    dev.records_fail = false;  // the engine still serves
    engine.submit({this->pinned(8 * kib, 0x33)});
    const auto after = engine.next(10s);
    EXPECT_TRUE(all_equal(this->read(after, 8 * kib, consumer), 0x33));
  }
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
}

TYPED_TEST(transfer_engine_group_failures, a_failed_packed_copy_fails_every_batch_staged_in_it_and_no_other) {
  failing_device dev(this->device());
  // Only the packed run of the two small pageable buffers is neither the
  // holder's copy nor the pinned batch's.
  dev.copy_fails = [](std::size_t bytes) { return bytes != holder_bytes && bytes != 8 * kib; };
  stream copy_stream(dev), consumer(dev);  // made before the allocator, gone after it
  alloc::caching_allocator a(dev);
  {
    transfer_engine engine(a, copy_stream.ref());
    engine.submit({this->pinned(holder_bytes, 0x11)});
    dev.wait_until_held();
    engine.submit({pageable(1000, 0x21)});
    engine.submit({pageable(3000, 0x22)});
    engine.submit({this->pinned(8 * kib, 0x23)});
    dev.let_go();
    (void)engine.next(10s);  // the holder
    for (int i = 0; i < 2; ++i) {
      try {
        (void)engine.next(10s);
        ADD_FAILURE() << "batch " << i + 1 << " arrived though the copy of its staged bytes failed";
      } catch (const backend_error& e) {
        EXPECT_EQ(e.call(), "copy");
      }
    }
    auto last = engine.next(10s);
    EXPECT_EQ(last.sequence(), 3u);
    EXPECT_TRUE(all_equal(this->read(last, 8 * kib, consumer), 0x23)) << "the pinned batch of the group is whole";
    const auto s = engine.stats();
    EXPECT_EQ(s.coalesced_groups, 2u) << "the holder, then the three as one group";
    EXPECT_EQ(s.batches_failed, 2u);
    EXPECT_EQ(s.batches_transferred, 2u);
    EXPECT_EQ(a.stats().allocations.aggregate.current, 1) << "the group's block, held by the batch that arrived";
    EXPECT_TRUE(eventually([&] { return engine.stats().pinned.allocations.aggregate.current == 0; }))
        << "the staging block of the failed copy was given back";
  }
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
}

}  // namespace
}  // namespace shoal::testing
