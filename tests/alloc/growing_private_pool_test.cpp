// Growing private pools (a CUDA graph's pool): memory from the device that
// stays the pool's until it is destroyed; frees that refuse to record an
// event (frees during capture); forgetting the streams a free block was
// last used on (between captures).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/backend/host_device.h"
#include "support/allocators.h"
#include "support/forwarding_device.h"
#include "support/invariants_during.h"
#include "support/sanitized.h"

namespace shoal::testing {
namespace {

constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Backend>
using growing_private_pool = allocator_test<Backend>;
TYPED_TEST_SUITE(growing_private_pool, backend_types, backend_names);

std::int64_t reserved(alloc::caching_allocator& a) { return a.stats().reserved_bytes.aggregate.current; }

TYPED_TEST(growing_private_pool, takes_memory_from_the_device_and_keeps_it_until_destroyed) {
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  EXPECT_EQ(reserved(a), 0) << "made empty";
  void *big, *small;
  {
    alloc::private_pool_scope scope(a, pool);
    big = a.allocate(3 * mib, {});
    small = a.allocate(512, {});
  }
  const std::int64_t held = reserved(a);
  EXPECT_GE(held, static_cast<std::int64_t>(3 * mib + 512)) << "counted as reserved: " << a.stats().to_json();
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(big, {});
  a.deallocate(small, {});
  a.empty_cache();
  EXPECT_EQ(reserved(a), held) << "empty_cache gives none of it back";

  void* outside = a.allocate(3 * mib, {});
  EXPECT_NE(outside, big) << "the pool's free memory serves no allocation outside it";
  EXPECT_GT(reserved(a), held);
  {
    alloc::private_pool_scope scope(a, pool);
    void* again = a.allocate(3 * mib, {});
    EXPECT_EQ(again, big) << "its own free memory serves it again";
    EXPECT_EQ(a.private_pool_allocated_blocks(pool), std::vector<void*>{again});
    EXPECT_THROW(a.destroy_private_pool(pool), invalid_argument) << "a block is live";
    a.deallocate(again, {});
    EXPECT_TRUE(a.private_pool_allocated_blocks(pool).empty());
  }
  a.deallocate(outside, {});
  a.empty_cache();
  EXPECT_EQ(reserved(a), held) << "only the pool's memory is left";
  const auto frees_before = a.stats().device_frees;
  a.destroy_private_pool(pool);
  EXPECT_EQ(reserved(a), 0) << a.stats().to_json();
  EXPECT_GT(a.stats().device_frees, frees_before) << "its segments went back to the device";
  EXPECT_THROW(alloc::private_pool_scope(a, pool), invalid_argument) << "its id is gone";
  EXPECT_TRUE(nothing_in_use(a.stats()));
  EXPECT_NO_THROW(a.check_invariants());
}

TYPED_TEST(growing_private_pool, grows_under_the_limit_with_plain_segments_whatever_the_setting) {
  auto& a = this->make("expandable_segments:true,memory_limit_mb:8");
  const auto pool = a.create_growing_private_pool();
  {
    alloc::private_pool_scope scope(a, pool);
    void* p = a.allocate(5 * mib, {});
    try {
      (void)a.allocate(5 * mib, {});
      ADD_FAILURE() << "10 MiB fit under a limit of 8";
    } catch (const out_of_memory& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("private sub-pool"), std::string::npos) << message;
      EXPECT_EQ(message.find("never grow"), std::string::npos) << "this one grows: " << message;
    }
    const auto snap = a.take_snapshot();
    ASSERT_EQ(snap.segments.size(), 1u);
    EXPECT_FALSE(snap.segments[0].expandable) << "give-backs unmap growable chunks; this memory never goes back";
    a.deallocate(p, {});
  }
  a.destroy_private_pool(pool);
  EXPECT_EQ(reserved(a), 0);
}

TYPED_TEST(growing_private_pool, refuses_to_take_live_blocks_back) {
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  void* p;
  {
    alloc::private_pool_scope scope(a, pool);
    p = a.allocate(mib, {});
  }
  EXPECT_THROW(a.clear_private_pool(pool, "", alloc::live_blocks::invalidate), invalid_argument);
  EXPECT_THROW(a.destroy_private_pool(pool, alloc::live_blocks::invalidate), invalid_argument);
  EXPECT_EQ(a.block_size(p), mib) << "still allocated";
  a.deallocate(p, {});
  a.destroy_private_pool(pool);
}

// Without forget_last_streams, a hand-out on another stream waits for the
// stream that last used the block — destroyed by its owner meanwhile, its
// work still queued: the allocator holds it. After it, the hand-out waits
// for nothing.
TYPED_TEST(growing_private_pool, forgetting_last_streams_lets_a_hand_out_wait_for_none) {
  using namespace std::chrono_literals;
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream second(dev);
  for (const bool forget : {false, true}) {
    const auto pool = a.create_growing_private_pool();
    alloc::private_pool_scope scope(a, pool);
    std::atomic<bool> ran_after{false};
    backend::event first_done(dev);
    void* p;
    {
      backend::stream first(dev);
      p = a.allocate(mib, first);
      a.deallocate(p, first);
      if (forget) a.forget_last_streams(pool);  // waits for the streams it forgets: before the delay
      dev.delay(first, 2s);
      first_done.record(first);
    }  // `first` is destroyed by its owner with its work still queued
    void* q = a.allocate(mib, second);
    EXPECT_EQ(q, p) << "the same memory";
    dev.host_task(second, [&ran_after] { ran_after = true; });
    if (forget) {
      dev.synchronize(second);
      EXPECT_FALSE(dev.query_event(first_done)) << "handed out with no wait, ahead of the first stream's queued work";
    } else {
      std::this_thread::sleep_for(100ms);
      EXPECT_FALSE(ran_after.load()) << "the hand-out waits for the destroyed stream's queued work";
    }
    a.deallocate(q, second);
    dev.synchronize(second);
    EXPECT_TRUE(ran_after.load());
  }
}

TYPED_TEST(growing_private_pool, a_free_without_events_refuses_what_would_record_one) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream first(dev), second(dev);
  void* p = a.allocate(mib, first);
  EXPECT_FALSE(a.deallocate_without_events(p, second)) << "freed on another stream: needs an event";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1) << "nothing changed";
  a.record_stream(p, second);
  EXPECT_FALSE(a.deallocate_without_events(p, first)) << "recorded on another stream";
  a.deallocate(p, first);

  void* q = a.allocate(mib, first);
  EXPECT_TRUE(a.deallocate_without_events(q, first)) << "its own stream, nothing recorded";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
  EXPECT_THROW((void)a.deallocate_without_events(q, first), invalid_argument) << "freed already";
  dev.synchronize(first);
  dev.synchronize(second);
  a.process_pending_frees();
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// Out of memory elsewhere takes nothing of the pool's: its free memory is
// its graphs' (they replay into it), not cache to give back.
TYPED_TEST(growing_private_pool, out_of_memory_elsewhere_gives_none_of_it_back) {
  auto& a = this->make("memory_limit_mb:24");
  const auto pool = a.create_growing_private_pool();
  {
    alloc::private_pool_scope scope(a, pool);
    a.deallocate(a.allocate(16 * mib, {}), {});  // free, and still the pool's
  }
  const std::int64_t held = reserved(a);
  EXPECT_THROW((void)a.allocate(16 * mib, {}), out_of_memory) << "only the pool's free memory would fit it";
  EXPECT_EQ(reserved(a), held);
  a.destroy_private_pool(pool);
  void* p = a.allocate(16 * mib, {});  // the pool's memory went back: it fits now
  a.deallocate(p, {});
}

// A snapshot names the private pool of each segment (a PyTorch snapshot of
// one memory pool lists its segments alone), also once a destroyed pool's
// sub-pool serves the next one, and no pool for the stream pools'.
TYPED_TEST(growing_private_pool, a_snapshot_names_each_segments_pool) {
  auto& a = this->make();
  const auto owners = [&] {
    std::vector<std::uint64_t> out;
    for (const auto& s : a.take_snapshot().segments) out.push_back(s.owner.value);
    std::sort(out.begin(), out.end());
    return out;
  };
  const auto first = a.create_growing_private_pool();
  {
    alloc::private_pool_scope scope(a, first);
    a.deallocate(a.allocate(4 * mib, {}), {});
  }
  void* outside = a.allocate(4 * mib, {});
  EXPECT_EQ(owners(), (std::vector<std::uint64_t>{0, first.value}));
  a.destroy_private_pool(first);
  const auto second = a.create_growing_private_pool();
  ASSERT_NE(second.value, first.value);
  {
    alloc::private_pool_scope scope(a, second);
    a.deallocate(a.allocate(4 * mib, {}), {});
  }
  EXPECT_EQ(owners(), (std::vector<std::uint64_t>{0, second.value})) << "the reused sub-pool names its new pool";
  a.deallocate(outside, {});
  a.destroy_private_pool(second);
}

// A destroy whose release observer throws still gives every segment back
// (they left the directory with the pool: nothing could reach them again)
// and then reports the error.
TYPED_TEST(growing_private_pool, a_destroy_whose_observer_throws_gives_the_memory_back_and_reports_it) {
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  {
    alloc::private_pool_scope scope(a, pool);
    void* first = a.allocate(18 * mib, {});
    void* second = a.allocate(4 * mib, {});  // does not fit beside the first: a second segment
    a.deallocate(first, {});
    a.deallocate(second, {});
  }
  ASSERT_EQ(a.take_snapshot().segments.size(), 2u);
  int told = 0;
  const auto id = a.add_release_observer([&](std::uintptr_t, std::size_t) {
    ++told;
    throw std::runtime_error("an observer that fails");
  });
  EXPECT_THROW(a.destroy_private_pool(pool), std::runtime_error);
  EXPECT_EQ(told, 2) << "every segment's observers were told, the failure notwithstanding";
  EXPECT_EQ(reserved(a), 0);
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_THROW(alloc::private_pool_scope(a, pool), invalid_argument) << "destroyed all the same";
  a.remove_hook(id);
}

// During a capture no allocation may wait for a stream: under the limit, the
// memory cached on another stream would have to go back first (a wait for
// that stream), so inside the scope the allocation is out of memory instead.
TYPED_TEST(growing_private_pool, inside_a_no_host_waits_scope_a_miss_gives_nothing_back_and_fails) {
  auto& dev = this->device();
  auto& a = this->make("memory_limit_mb:24");
  backend::stream first(dev), second(dev);
  a.deallocate(a.allocate(20 * mib, first), first);  // cached on `first`
  const auto frees = a.stats().device_frees;
  {
    alloc::no_host_waits_scope no_waits;
    EXPECT_THROW((void)a.allocate(20 * mib, second), out_of_memory) << "the cache of `first` stays where it is";
    EXPECT_EQ(a.stats().device_frees, frees);
  }
  void* p = a.allocate(20 * mib, second);  // outside: the cache goes back, then it fits
  EXPECT_GT(a.stats().device_frees, frees);
  a.deallocate(p, second);
  dev.synchronize(first);
  dev.synchronize(second);
}

// A destroyed pool's counts stay in the totals: cumulative figures and
// peaks never go down when a pool goes (they did when its counters left
// with it: checked), and current = allocated - freed still holds.
TYPED_TEST(growing_private_pool, destroying_it_keeps_its_counts_in_the_totals) {
  auto& a = this->make();
  void* outside = a.allocate(4 * kib, {});
  auto& dev = this->device();
  void* memory = dev.allocate_segment(8 * mib);
  for (const bool region : {false, true}) {
    const auto pool = region ? a.create_private_pool(memory, 8 * mib, {{"all", 8 * mib}})
                             : a.create_growing_private_pool();
    {
      alloc::private_pool_scope scope(a, pool, region ? "all" : "");
      for (int i = 0; i < 5; ++i) a.deallocate(a.allocate(mib + i * kib, {}), {});
    }
    const alloc::allocator_stats before = a.stats();
    a.destroy_private_pool(pool);
    const alloc::allocator_stats after = a.stats();
    const auto same_or_more = [&](const alloc::stat& was, const alloc::stat& now, const char* name) {
      EXPECT_GE(now.allocated, was.allocated) << name << (region ? ", region pool" : ", growing pool");
      EXPECT_GE(now.freed, was.freed) << name;
      EXPECT_GE(now.peak, was.peak) << name;
      EXPECT_EQ(now.current, now.allocated - now.freed) << name;
    };
    same_or_more(before.allocations.aggregate, after.allocations.aggregate, "allocations");
    same_or_more(before.allocated_bytes.aggregate, after.allocated_bytes.aggregate, "allocated bytes");
    same_or_more(before.requested_bytes.aggregate, after.requested_bytes.aggregate, "requested bytes");
    same_or_more(before.segments.aggregate, after.segments.aggregate, "segments");
    EXPECT_GE(after.reserved_bytes.aggregate.peak, before.reserved_bytes.aggregate.peak);
    EXPECT_EQ(after.allocations.aggregate.current, 1) << "the block outside";
  }
  const alloc::allocator_stats total = a.stats();
  EXPECT_GE(total.allocations.aggregate.allocated, 11) << "1 outside + 5 in each pool";
  a.reset_accumulated_stats();
  a.reset_peak_stats();
  const alloc::allocator_stats reset = a.stats();
  EXPECT_EQ(reset.allocations.aggregate.allocated, 1) << "only the live block's";
  EXPECT_EQ(reset.allocations.aggregate.freed, 0);
  EXPECT_EQ(reset.allocations.aggregate.peak, 1);
  a.deallocate(outside, {});
  dev.free_segment(memory);
}

// stats() read while pools are made, used and destroyed on another thread:
// a destroyed pool's counts move to the totals at once for every reader, so
// the cumulative count never goes down and current = allocated - freed in
// every reading (a count seen in the pool and again in the totals, or in
// neither, would break one of them).
TYPED_TEST(growing_private_pool, stats_read_during_destroys_never_count_a_pool_twice_or_not_at_all) {
  auto& a = this->make();
  // Sanitized builds: a quarter of the rounds (the allocator checks its
  // invariants at every step there, and the reader's stats() calls crowd
  // the churn out: under TSan 60 rounds took 41 s beside another test and
  // 148 s alone). Each round still destroys 65 pools under a reader that
  // never stops, so its readings still cross hundreds of destroys.
  const int rounds = fewer_when_sanitized(60, 4);
  std::atomic<bool> done{false};
  std::thread churn([&] {
    for (int round = 0; round < rounds; ++round) {
      const auto pool = a.create_growing_private_pool();
      // Pools made after it are walked after it: a reader that counted it
      // in the pool has this long before it reads the totals.
      std::vector<alloc::private_pool_id> idle;
      for (int i = 0; i < 64; ++i) idle.push_back(a.create_growing_private_pool());
      {
        alloc::private_pool_scope scope(a, pool);
        for (int i = 0; i < 4; ++i) a.deallocate(a.allocate(64 * kib * (1 + i), {}), {});
      }
      a.destroy_private_pool(pool);
      for (const auto id : idle) a.destroy_private_pool(id);
    }
    done = true;
  });
  std::int64_t last = 0;
  int readings = 0;
  while (!done || readings == 0) {
    const alloc::stat s = a.stats().allocations.aggregate;
    ASSERT_GE(s.allocated, last) << "reading " << readings;
    ASSERT_EQ(s.current, s.allocated - s.freed) << "reading " << readings;
    last = s.allocated;
    ++readings;
    // Sanitized builds: a pause between readings. stats() holds the
    // allocator's retired-pool lock as it walks the pools, and a reader
    // taking it back at once starved the churn there (148 s alone under
    // TSan, past ctest's timeout); a reading still lands amid the destroys.
    if constexpr (sanitized_build) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  churn.join();
  EXPECT_EQ(a.stats().allocations.aggregate.allocated, rounds * 4);
}

TYPED_TEST(growing_private_pool, invariants_checked_during_destroys_hold) {
  // A destroyed growing pool's segments leave the directory before they go
  // back to the device: a check in between must not count them reserved by
  // the segment source and by no pool.
  auto& a = this->make();
  expect_invariants_hold_during(a, [&] {
    for (int round = 0; round < 200; ++round) {
      const auto pool = a.create_growing_private_pool();
      {
        alloc::private_pool_scope scope(a, pool);
        for (int i = 0; i < 4; ++i) a.deallocate(a.allocate(3 * mib * (1 + i), {}), {});
      }
      a.destroy_private_pool(pool);
    }
  });
}

// Runs `before_sync` (once) when the next stream synchronize begins: a free
// that lands while a destroy drains the pool, after the drain looked.
struct synchronize_hooking_device : forwarding_device {
  using forwarding_device::forwarding_device;
  std::function<void()> before_sync;
  void synchronize(backend::stream_ref s) override {
    if (auto run = std::exchange(before_sync, nullptr)) run();
    forwarding_device::synchronize(s);
  }
};

// A free that comes while the destroy drains the pool (its stream's work on
// the block queued after the drain looked) sends the destroy round again:
// the memory goes back only after that stream has run its work.
TEST(growing_private_pool_destroy, a_free_during_the_drain_is_waited_for_before_the_memory_goes_back) {
  backend::host_device host;
  synchronize_hooking_device dev(host);
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(""));
  backend::stream s0(dev), s1(dev);
  const auto id = a.create_growing_private_pool();
  void* p = nullptr;
  void* q = nullptr;
  {
    alloc::private_pool_scope scope(a, id);
    p = a.allocate(mib, s1);
    q = a.allocate(mib, s0);
  }
  a.deallocate(q, s0);  // a free block that last ran on s0: the drain synchronizes s0
  backend::event_ref last_use = dev.create_event();
  dev.before_sync = [&] {
    // s1 is held for 200 ms, then fills p (its last use) and p is freed on it.
    dev.host_task(s1, [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); });
    dev.fill(s1, p, 0xab, mib);
    dev.record(last_use, s1);
    a.deallocate(p, s1);
  };
  (void)a.destroy_private_pool(id);
  EXPECT_TRUE(dev.query_event(last_use)) << "the memory went back while s1 still had work on it";
  dev.synchronize(s1);
  dev.destroy_event(last_use);
  EXPECT_NO_THROW(a.check_invariants());
}

}  // namespace
}  // namespace shoal::testing
