// A private pool's creation over a region that runs out of host memory
// midway (each of its heap allocations refused in turn): it throws
// std::bad_alloc and leaves the allocator as it was — no segment of it in
// the directory, its (possibly reused) sub-pools given back empty, the
// region's orphaned tombstones still owed their late frees — and the next
// creation on the region works. And a late free of such a tombstone that
// comes while the creation is stopped at one of its allocations is taken
// exactly once.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <new>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

using alloc::live_blocks;
constexpr std::size_t kib = 1024, mib = kib * kib;

// Creates a two-part pool over `region` on a thread of its own whose every
// `period`-th heap allocation is refused (counted from the thread's start).
// True when it was made (then `made` holds it), false on std::bad_alloc.
bool create_refusing(alloc::caching_allocator& a, void* region, int period, alloc::private_pool_id& made) {
  bool created = false;
  std::thread creator([&] {
    const refusing_allocations_elsewhere refuse(period);
    refusing_allocations_elsewhere::join();
    try {
      made = a.create_private_pool(region, 2 * mib, {{"weights", mib}, {"scratch", mib}});
      created = true;
    } catch (const std::bad_alloc&) {
    }
  });
  creator.join();
  return created;
}

TEST(region_pool_creation_failures, a_creation_refused_memory_midway_leaves_nothing_behind) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  void* region = dev.allocate_segment(2 * mib);
  const auto base = reinterpret_cast<std::uintptr_t>(region);
  int failed = 0;
  for (int period = 1; period <= 40; ++period) {
    SCOPED_TRACE("refusing every " + std::to_string(period) + "-th allocation");
    // One live block in each sub-pool, taken back by a forced destroy: two
    // orphaned tombstones in the region, one per part of the next pool.
    const auto old = a.create_private_pool(region, 2 * mib, {{"weights", mib}, {"scratch", mib}});
    void* weights_block = nullptr;
    void* scratch_block = nullptr;
    {
      alloc::private_pool_scope scope(a, old, "weights");
      weights_block = a.allocate(128 * kib, {});
    }
    {
      alloc::private_pool_scope scope(a, old, "scratch");
      scratch_block = a.allocate(128 * kib, {});
    }
    ASSERT_GE(reinterpret_cast<std::uintptr_t>(scratch_block), base + mib);
    (void)a.destroy_private_pool(old, live_blocks::invalidate);

    alloc::private_pool_id pool{};
    if (!create_refusing(a, region, period, pool)) {
      ++failed;
      ASSERT_NO_THROW(a.check_invariants()) << "a failed creation left part of itself behind";
      EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "a failed creation's segments are still counted";
      pool = a.create_private_pool(region, 2 * mib, {{"weights", mib}, {"scratch", mib}});
    }
    a.check_invariants();
    // The orphans came through: each part holds its tombstone, so neither
    // is free whole until the late frees come.
    for (const char* part : {"weights", "scratch"}) {
      alloc::private_pool_scope scope(a, pool, part);
      EXPECT_THROW((void)a.allocate(mib, {}), out_of_memory) << "sub-pool '" << part << "' lost its tombstone";
    }
    a.deallocate(weights_block, {});
    a.deallocate(scratch_block, {});
    for (const char* part : {"weights", "scratch"}) {
      alloc::private_pool_scope scope(a, pool, part);
      void* whole = nullptr;
      ASSERT_NO_THROW(whole = a.allocate(mib, {})) << "sub-pool '" << part << "' is not whole after the late frees";
      a.deallocate(whole, {});
    }
    a.destroy_private_pool(pool);
    a.check_invariants();
  }
  // Every allocation the creation makes was refused first in some round,
  // and the last rounds refused none it needed.
  EXPECT_GE(failed, 5);
  EXPECT_LT(failed, 40) << "no creation succeeded: raise the periods tried";
  dev.free_segment(region);
}

// One round of the test below: a pool over `region` with two live blocks,
// the second taken back by a forced destroy (an orphaned tombstone); then a
// creation over the region stopped at its `nth` heap allocation, which is
// refused, while another thread frees the tombstone. With `stale_cache` the
// freeing thread freed the first block into the old pool just before, so
// its per-thread cache still leads to the sub-pool object the creation
// reuses. Returns whether the creation made its pool (then in `made`).
struct late_free_round {
  bool created = false;
  bool refused = false;
  alloc::private_pool_id made{};
  void* tombstone = nullptr;
};
late_free_round free_during_creation(alloc::caching_allocator& a, void* region, int nth, bool stale_cache) {
  late_free_round round;
  const auto old = a.create_private_pool(region, 2 * mib);
  void* first = nullptr;
  {
    alloc::private_pool_scope scope(a, old);
    first = a.allocate(128 * kib, {});
    round.tombstone = a.allocate(128 * kib, {});
  }
  std::mutex m;
  std::condition_variable changed;
  bool cached = false, asked = false, freed = false;
  const auto ask_for_the_free = [&] {
    const std::lock_guard lock(m);
    asked = true;
    changed.notify_all();
  };
  // A throw on either thread is rethrown here after both joined, so that a
  // failure fails this test rather than ending the binary.
  std::exception_ptr owner_error, creator_error, here_error;
  std::thread owner([&] {
    try {
      if (stale_cache) a.deallocate(first, {});  // looked up in the directory: cached here
      {
        std::unique_lock lock(m);
        cached = true;
        changed.notify_all();
        changed.wait(lock, [&] { return asked; });
      }
      a.deallocate(round.tombstone, {});
    } catch (...) {
      owner_error = std::current_exception();
    }
    const std::lock_guard lock(m);
    cached = freed = true;  // cached too: a throw before it must not leave the test waiting
    changed.notify_all();
  });
  try {
    {
      std::unique_lock lock(m);
      changed.wait(lock, [&] { return cached; });
    }
    if (!stale_cache) a.deallocate(first, {});
    (void)a.destroy_private_pool(old, live_blocks::invalidate);
    std::thread creator([&] {
      try {
        // Stopped at its nth allocation: the free runs now, or, where it
        // waits for the creation, after it (a bounded wait here, then the
        // refusal).
        const refusing_one_allocation refuse(nth, [&] {
          ask_for_the_free();
          std::unique_lock lock(m);
          changed.wait_for(lock, std::chrono::milliseconds(20), [&] { return freed; });
        });
        try {
          round.made = a.create_private_pool(region, 2 * mib);
          round.created = true;
        } catch (const std::bad_alloc&) {
        }
        round.refused = refuse.refused();
      } catch (...) {
        creator_error = std::current_exception();
      }
    });
    creator.join();
  } catch (...) {
    here_error = std::current_exception();
  }
  ask_for_the_free();  // the creation made fewer allocations (or this failed): the free comes now
  owner.join();
  for (const auto& e : {here_error, creator_error, owner_error}) {
    if (e) std::rethrow_exception(e);
  }
  return round;
}

TEST(region_pool_creation_failures, a_late_free_during_a_failing_creation_frees_its_tombstone_once) {
  // Whether the free lands before the creation took the orphan, on the
  // creation's sub-pool while it is not yet (or no longer) in the
  // directory, or after: it is accepted once, a second free of the pointer
  // is refused, and the next pool over the region is whole.
  for (const bool stale_cache : {true, false}) {
    SCOPED_TRACE(stale_cache ? "the freeing thread's cache leads to the reused sub-pool" : "a fresh freeing thread");
    backend::host_device dev({.capacity_bytes = 64 * mib});
    alloc::caching_allocator a(dev, alloc::allocator_config{});
    void* region = dev.allocate_segment(2 * mib);
    int nth = 1;
    for (;; ++nth) {
      SCOPED_TRACE("the creation's allocation " + std::to_string(nth) + " refused");
      late_free_round r = free_during_creation(a, region, nth, stale_cache);
      if (!r.created) r.made = a.create_private_pool(region, 2 * mib);
      a.check_invariants();
      EXPECT_THROW(a.deallocate(r.tombstone, {}), invalid_argument) << "the tombstone was freed twice";
      {
        alloc::private_pool_scope scope(a, r.made);
        void* whole = nullptr;
        ASSERT_NO_THROW(whole = a.allocate(2 * mib, {})) << "the new pool kept a tombstone whose free happened";
        a.deallocate(whole, {});
      }
      a.destroy_private_pool(r.made);
      if (!r.refused) break;  // the creation made fewer allocations than nth
    }
    EXPECT_GE(nth, 5) << "the creation made fewer allocations than expected: the rounds cover little";
    dev.free_segment(region);
  }
}

}  // namespace
}  // namespace shoal::testing
