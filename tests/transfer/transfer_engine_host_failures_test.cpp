// The engine when the host refuses it something: threads it cannot start
// (a pids cgroup limit, RLIMIT_NPROC) are a typed error from its
// constructor, not the end of the process; host memory that runs out once
// a copy is enqueued leaves the copy's source held until the copy has run;
// host memory that runs out anywhere in the engine's thread fails or delays
// batches, never loses one nor ends the process.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/transfer/transfer_engine.h"
#include "support/backends.h"
#include "support/forwarding_device.h"
#include "support/host_buffers.h"
#include "support/refused_allocations.h"
#include "support/refused_threads.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using transfer::host_buffer;
using transfer::transfer_engine;
constexpr std::size_t kib = 1024;

template <class Backend>
class transfer_engine_host_failures : public backend_test<Backend> {};
TYPED_TEST_SUITE(transfer_engine_host_failures, backend_types, backend_names);

TYPED_TEST(transfer_engine_host_failures, staging_helpers_that_cannot_all_be_started_are_a_backend_error) {
  stream copy_stream(this->device());
  alloc::caching_allocator a(this->device(), {});
  try {
    refusing_threads refusal(2);  // two of the four helpers start, the third does not
    transfer_engine engine(a, copy_stream.ref(), {.staging_helpers = 4});
    ADD_FAILURE() << "the engine started four helpers where only two could";
  } catch (const backend_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("2 of 4"), std::string::npos) << what;
    EXPECT_NE(what.find("staging_helpers"), std::string::npos) << "names the setting that asks for them: " << what;
  }
}

TYPED_TEST(transfer_engine_host_failures, an_engine_thread_that_cannot_be_started_is_a_backend_error) {
  stream copy_stream(this->device());
  alloc::caching_allocator a(this->device(), {});
  refusing_threads refusal(2);  // both helpers start, the engine's own thread does not
  EXPECT_THROW(transfer_engine(a, copy_stream.ref(), {.staging_helpers = 2}), backend_error);
  EXPECT_EQ(refusal.refused(), 1);
}

// Refuses the engine thread's next heap allocation once it has enqueued a
// copy (of `bytes` bytes, when arm names a size), until it records the
// group's ready event: from the first copy enqueued on, nothing may throw
// before the sources read directly are held.
class refusing_after_copy_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;

  void copy(backend::stream_ref s, void* dst, const void* src, std::size_t bytes) override {
    forwarding_device::copy(s, dst, src, bytes);
    if ((copy_bytes_ == 0 || bytes == copy_bytes_) && arm_.exchange(false)) refusal_.emplace(1, [] {});
  }
  void record(backend::event_ref event, backend::stream_ref s) override {
    if (refusal_ && refusal_->refused()) refused_ = true;
    refusal_.reset();
    forwarding_device::record(event, s);
  }

  void arm(std::size_t copy_bytes = 0) {
    copy_bytes_ = copy_bytes;
    arm_ = true;
  }
  [[nodiscard]] bool refused() const { return refused_; }

 private:
  std::atomic<std::size_t> copy_bytes_{0};
  std::atomic<bool> arm_{false}, refused_{false};
  static thread_local std::optional<refusing_one_allocation> refusal_;  // the engine thread's
};
thread_local std::optional<refusing_one_allocation> refusing_after_copy_device::refusal_;

TYPED_TEST(transfer_engine_host_failures, a_pinned_source_stays_held_when_host_memory_runs_out_after_its_copy) {
  refusing_after_copy_device dev(this->device());
  {
    stream copy_stream(dev), consumer(dev);
    alloc::caching_allocator a(dev, {});
    alloc::caching_allocator pinned_memory(dev, alloc::allocator_config::parse("memory:pinned_host"));
    void* block = pinned_memory.allocate(64 * kib, consumer.ref());
    std::memset(block, 0x3C, 64 * kib);
    {
      transfer_engine engine(a, copy_stream.ref());
      std::atomic<bool> released{false};
      std::shared_ptr<const void> keep(block, [&](const void*) { released = true; });
      dev.delay(engine.stream(), 200ms);  // the engine's copies run late
      dev.arm();
      engine.submit({host_buffer{block, 64 * kib, true, std::move(keep)}});
      std::optional<transfer::transferred_batch> batch;
      try {
        batch = engine.next(10s);
      } catch (const std::bad_alloc&) {
        ADD_FAILURE() << "the batch failed for host memory after its copy was enqueued";
      }
      std::this_thread::sleep_for(50ms);
      EXPECT_FALSE(released) << "the source was let go while the copy reading it was still queued";
      EXPECT_FALSE(dev.refused()) << "the engine allocated between its first copy and its ready event";
      if (batch) {
        batch->wait_on(consumer.ref());
        EXPECT_TRUE(all_equal(this->read(batch->storages()[0].data(), 64 * kib, consumer.ref()), 0x3C));
      }
    }
    pinned_memory.deallocate(block, consumer.ref());
    dev.synchronize(consumer.ref());
  }
}

// Throws from every event query while armed, as CUDA does for each query
// after an earlier asynchronous failure of the context.
class failing_queries_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;

  [[nodiscard]] bool query_event(backend::event_ref event) override {
    if (failing_) throw stream_error("cudaEventQuery: an earlier asynchronous launch failed (injected)");
    return forwarding_device::query_event(event);
  }
  void fail_queries(bool fail) { failing_ = fail; }

 private:
  std::atomic<bool> failing_{false};
};

TYPED_TEST(transfer_engine_host_failures, an_event_query_that_throws_lets_go_of_the_sources_and_ends_no_process) {
  failing_queries_device dev(this->device());
  {
    stream copy_stream(dev), consumer(dev);
    alloc::caching_allocator a(dev, {});
    alloc::caching_allocator pinned_memory(dev, alloc::allocator_config::parse("memory:pinned_host"));
    void* block = pinned_memory.allocate(64 * kib, consumer.ref());
    std::memset(block, 0x5A, 64 * kib);
    {
      transfer_engine engine(a, copy_stream.ref());
      std::atomic<bool> released{false};
      std::shared_ptr<const void> keep(block, [&](const void*) { released = true; });
      dev.fail_queries(true);  // the engine thread's next look at its held sources throws
      engine.submit({host_buffer{block, 64 * kib, true, std::move(keep)}});
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      while (!released && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
      EXPECT_TRUE(released) << "the source read directly was never let go of";
      dev.fail_queries(false);
      const transfer::transferred_batch batch = engine.next(10s);
      batch.wait_on(consumer.ref());
      EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 64 * kib, consumer.ref()), 0x5A));
      // The engine goes on.
      std::shared_ptr<const void> again(block, [](const void*) {});
      engine.submit({host_buffer{block, 64 * kib, true, std::move(again)}});
      const transfer::transferred_batch second = engine.next(10s);
      second.synchronize();
    }
    pinned_memory.deallocate(block, consumer.ref());
    dev.synchronize(consumer.ref());
  }
}

// Joins the thread that enqueues copies (the engine's) to
// refusing_allocations_elsewhere, so that a scope of it refuses that
// thread's allocations, wherever in its loop they come.
class joining_copier_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;

  void copy(backend::stream_ref s, void* dst, const void* src, std::size_t bytes) override {
    refusing_allocations_elsewhere::join();
    forwarding_device::copy(s, dst, src, bytes);
  }
};

TYPED_TEST(transfer_engine_host_failures, host_memory_that_runs_out_in_the_engine_thread_loses_no_batch) {
  joining_copier_device dev(this->device());
  stream copy_stream(dev), consumer(dev);
  alloc::caching_allocator a(dev, {});
  transfer_engine engine(a, copy_stream.ref(), {.max_batches_in_flight = 8});
  const std::vector<std::uint8_t> source(4 * kib, 0x2B);
  const auto submit = [&] { engine.submit({host_buffer{source.data(), source.size(), false, nullptr}}); };
  submit();
  engine.next(10s).synchronize();  // its copy joined the engine's thread
  std::uint64_t expected = 1;
  int refused = 0, failed = 0;
  // Each period refuses other allocations of the thread's loop: the group's
  // room, its outcomes' room, the copier's bookkeeping, the allocator's.
  for (int period = 1; period <= 40; ++period) {
    const std::uint64_t before = engine.stats().batches_submitted;
    {
      refusing_allocations_elsewhere refusal(period);
      for (int i = 0; i < 4; ++i) submit();  // grouped together when the thread was busy
      const auto deadline = std::chrono::steady_clock::now() + 50ms;
      while (std::chrono::steady_clock::now() < deadline) {
        const transfer::transfer_stats s = engine.stats();
        if (s.batches_transferred + s.batches_failed == before + 4) break;
        std::this_thread::sleep_for(1ms);
      }
      refused += refusing_allocations_elsewhere::refused();
    }
    // Every batch comes, once and in order: transferred, or failed with
    // its own error (later, once memory came back, for those held back).
    for (int i = 0; i < 4; ++i, ++expected) {
      transfer_engine::taken_batch taken = engine.take(10s);
      ASSERT_EQ(taken.sequence, expected) << "period " << period;
      if (taken.batch) {
        taken.batch->wait_on(consumer.ref());
        EXPECT_TRUE(all_equal(this->read(taken.batch->storages()[0].data(), 4 * kib, consumer.ref()), 0x2B));
      } else {
        ASSERT_TRUE(taken.error) << "a batch came with neither its storages nor an error";
        ++failed;
      }
    }
  }
  EXPECT_GT(refused, 0) << "no allocation of the engine's thread was refused: the test proves nothing";
  EXPECT_FALSE(engine.try_next().has_value()) << "a batch was delivered twice";
  const transfer::transfer_stats s = engine.stats();
  EXPECT_EQ(s.in_flight, 0u);
  EXPECT_EQ(s.batches_failed, static_cast<std::uint64_t>(failed));
  EXPECT_EQ(s.batches_taken, s.batches_submitted);
  // The engine goes on.
  submit();
  const transfer::transferred_batch last = engine.next(10s);
  last.wait_on(consumer.ref());
  EXPECT_TRUE(all_equal(this->read(last.storages()[0].data(), 4 * kib, consumer.ref()), 0x2B));
}

// No host memory for even one batch's outcome: the engine's thread takes no
// job, and each retry (every millisecond) is refused again until memory
// comes back; then every batch is copied, none failed for the wait.
TYPED_TEST(transfer_engine_host_failures, batches_with_no_room_for_one_outcome_stay_queued_until_memory_comes_back) {
  using clock = std::chrono::steady_clock;
  joining_copier_device dev(this->device());
  stream copy_stream(dev), consumer(dev);
  alloc::caching_allocator a(dev, {});
  transfer_engine engine(a, copy_stream.ref(), {.max_batches_in_flight = 8});
  const std::vector<std::uint8_t> source(4 * kib, 0x6E);
  const auto submit = [&] { return engine.submit({host_buffer{source.data(), source.size(), false, nullptr}}); };
  submit();
  engine.next(20s).synchronize();  // its copy joined the engine's thread; no outcome node is left over
  const transfer::transfer_stats before = engine.stats();
  std::vector<std::uint64_t> sequences;
  {
    refusing_allocations_elsewhere refusal(1);  // every allocation of the engine's thread
    for (int i = 0; i < 3; ++i) sequences.push_back(submit());
    // Several refusals: the thread came back for the jobs and was refused again.
    const auto deadline = clock::now() + 20s;
    while (refusing_allocations_elsewhere::refused() < 5 && clock::now() < deadline) std::this_thread::sleep_for(1ms);
    ASSERT_GE(refusing_allocations_elsewhere::refused(), 5) << "the engine's thread did not retry the queued jobs";
    const transfer::transfer_stats held = engine.stats();
    EXPECT_EQ(held.batches_submitted, before.batches_submitted + 3);
    EXPECT_EQ(held.in_flight, 3u) << "a queued batch was lost";
    EXPECT_EQ(held.batches_transferred, before.batches_transferred) << "copied with no room for its outcome";
    EXPECT_EQ(held.batches_failed, before.batches_failed) << "a batch failed for want of room it may wait for";
    EXPECT_EQ(held.copies, before.copies);
    EXPECT_FALSE(engine.try_next().has_value()) << "an outcome was delivered while memory was refused";
  }
  // Memory is back: the next retry takes the jobs.
  for (const std::uint64_t expected : sequences) {
    transfer_engine::taken_batch taken = engine.take(20s);
    ASSERT_EQ(taken.sequence, expected);
    ASSERT_TRUE(taken.batch) << "batch " << expected << " failed after its wait";
    taken.batch->wait_on(consumer.ref());
    EXPECT_TRUE(all_equal(this->read(taken.batch->storages()[0].data(), 4 * kib, consumer.ref()), 0x6E));
  }
  const transfer::transfer_stats after = engine.stats();
  EXPECT_EQ(after.batches_transferred, before.batches_transferred + 3);
  EXPECT_EQ(after.batches_failed, before.batches_failed);
  EXPECT_EQ(after.in_flight, 0u);
  EXPECT_FALSE(engine.try_next().has_value()) << "a batch was delivered twice";
}

// A staging block's free takes host memory (its place among the pinned
// allocator's pending frees); refused, the block is freed again later rather
// than kept from a ring of one chunk for the engine's life. The first batch
// is `first_bytes`; the refusal comes after its copy of `refused_after_copy_of`
// bytes, whose block is freed next.
template <class Test>
void a_refused_staging_free_goes_back_to_the_ring(Test& test, std::size_t first_bytes,
                                                  std::size_t refused_after_copy_of) {
  constexpr std::size_t mib = kib * kib;
  refusing_after_copy_device dev(test.device());
  stream copy_stream(dev);
  alloc::caching_allocator a(dev, {});
  transfer_engine engine(a, copy_stream.ref(), {.max_pinned_bytes = 4 * mib, .staging_chunk_bytes = 4 * mib});
  dev.arm(refused_after_copy_of);
  engine.submit({pageable(first_bytes, 1)});
  engine.next(10s).synchronize();
  ASSERT_TRUE(dev.refused()) << "the test refused no free: it shows nothing";
  // No batch in flight: the block whose free was refused is back with the
  // allocator (the engine's thread frees it again as it waits).
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (engine.stats().pinned.allocations.aggregate.current != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(engine.stats().pinned.allocations.aggregate.current, 0) << "a staging block stayed allocated";
  for (int i = 0; i < 3; ++i) {  // a ring of one chunk: each fails with out_of_memory if the block was lost
    engine.submit({pageable(8 * mib, 2)});
    EXPECT_NO_THROW(engine.next(10s).synchronize());
  }
}

TYPED_TEST(transfer_engine_host_failures, a_staging_block_whose_free_the_host_refused_goes_back_to_the_ring) {
  constexpr std::size_t mib = kib * kib;
  a_refused_staging_free_goes_back_to_the_ring(*this, 8 * mib, 4 * mib);  // the first chunk's block
}

// The same for a packed batch's block (staging_pack::give_back frees it
// after the run's copy): kept, it would hold the small pool's segment, and
// with it half the ring, for good.
TYPED_TEST(transfer_engine_host_failures, a_packed_batchs_block_whose_free_the_host_refused_goes_back_to_the_ring) {
  a_refused_staging_free_goes_back_to_the_ring(*this, 300 * kib, 300 * kib);  // the run's one copy
}

}  // namespace
}  // namespace shoal::testing
