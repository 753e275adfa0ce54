// Private pools over a region, made and destroyed while other threads look
// at the allocator: the invariant checker never sees a half-made or
// half-destroyed pool, and the late free of a block a destroy turned into
// a tombstone is counted exactly once, whichever thread gets there first.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "support/invariants_during.h"

namespace shoal::testing {
namespace {

using alloc::live_blocks;
constexpr std::size_t kib = 1024, mib = kib * kib;

// Busy-waits about `n` steps; the fence keeps the compiler from folding the loop.
void spin(int n) {
  for (int i = 0; i < n; ++i) std::atomic_signal_fence(std::memory_order_seq_cst);
}

TEST(region_pool_races, invariants_checked_during_creates_and_destroys_hold) {
  // A made pool's segments enter the segment directory together with the
  // pool: a check in between must not find a segment that is in no pool.
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  void* region = dev.allocate_segment(4 * mib);
  expect_invariants_hold_during(a, [&] {
    for (int round = 0; round < 2000; ++round) {
      const auto pool = a.create_private_pool(region, 4 * mib, {{"weights", 3 * mib}, {"scratch", mib}});
      a.destroy_private_pool(pool);
    }
  });
  dev.free_segment(region);
}

TEST(region_pool_races, a_late_free_racing_a_forced_destroy_leaves_no_tombstone_behind) {
  // One thread frees a block while another destroys its pool, taking the
  // block back (live_blocks::invalidate). Whether the free comes before
  // the destroy, after it (the tombstone's late free, found as an orphan),
  // or while it runs, the whole region is free again for the next pool
  // made on it: no tombstone of a free that already happened stays.
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  void* region = dev.allocate_segment(2 * mib);
  for (int round = 0; round < 3000; ++round) {
    const auto pool = a.create_private_pool(region, 2 * mib);
    void* block = nullptr;
    {
      alloc::private_pool_scope scope(a, pool);
      block = a.allocate(128 * kib, {});
    }
    std::atomic<bool> go{false};
    std::exception_ptr free_error;
    // The free starts a little later each round (0-255 spins), so that over
    // the rounds it lands in every part of the destroy, its locked section too.
    const int delay = round % 256;
    std::thread owner([&] {
      while (!go.load(std::memory_order_acquire)) {
      }
      spin(delay * 4);
      try {
        a.deallocate(block, {});
      } catch (...) {
        free_error = std::current_exception();
      }
    });
    go.store(true, std::memory_order_release);
    (void)a.destroy_private_pool(pool, live_blocks::invalidate);
    owner.join();
    if (free_error) std::rethrow_exception(free_error);
    const auto again = a.create_private_pool(region, 2 * mib);
    {
      alloc::private_pool_scope scope(a, again);
      void* whole = nullptr;
      ASSERT_NO_THROW(whole = a.allocate(2 * mib, {})) << "round " << round << ": a tombstone outlived its free";
      a.deallocate(whole, {});
    }
    a.destroy_private_pool(again);
  }
  dev.free_segment(region);
}

// Destroys a pool over `region` that holds one live block, taking it back
// (the block becomes an orphaned tombstone), then runs `late` on it on
// another thread while a new pool is made on the region. `late` starts
// 0-255 spins later round by round, so that over the rounds it lands before,
// inside and after the creation's hand-off of the orphans; `created` turns
// true when the creation returned. Returns the new pool, and what `late`
// threw.
struct handoff_round {
  alloc::private_pool_id pool;
  std::exception_ptr late_error;
};
handoff_round race_a_creation(alloc::caching_allocator& a, void* region, std::size_t bytes, int round,
                              const std::function<void(void*, const std::atomic<bool>& created)>& late) {
  const auto old = a.create_private_pool(region, bytes);
  void* block = nullptr;
  {
    alloc::private_pool_scope scope(a, old);
    block = a.allocate(128 * kib, {});
  }
  (void)a.destroy_private_pool(old, live_blocks::invalidate);
  std::atomic<bool> go{false}, created{false};
  handoff_round result{};
  const int delay = round % 256;
  std::thread owner([&] {
    while (!go.load(std::memory_order_acquire)) {
    }
    spin(delay * 4);
    try {
      late(block, created);
    } catch (...) {
      result.late_error = std::current_exception();
    }
  });
  go.store(true, std::memory_order_release);
  result.pool = a.create_private_pool(region, bytes);
  created = true;
  owner.join();
  return result;
}

TEST(region_pool_races, a_late_free_racing_a_new_pool_on_the_region_frees_its_tombstone_once) {
  // The orphan becomes the new pool's tombstone while the late free looks
  // for it. Whether the free takes the orphan (before) or the new pool's
  // tombstone (after), it succeeds and the new pool's whole region is free.
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  void* region = dev.allocate_segment(2 * mib);
  for (int round = 0; round < 3000; ++round) {
    const auto r = race_a_creation(a, region, 2 * mib, round, [&](void* block, const auto&) { a.deallocate(block, {}); });
    if (r.late_error) std::rethrow_exception(r.late_error);
    {
      alloc::private_pool_scope scope(a, r.pool);
      void* whole = nullptr;
      ASSERT_NO_THROW(whole = a.allocate(2 * mib, {})) << "round " << round << ": the new pool kept a freed tombstone";
      a.deallocate(whole, {});
    }
    a.destroy_private_pool(r.pool);
  }
  a.check_invariants();
  dev.free_segment(region);
}

TEST(region_pool_races, record_stream_on_a_tombstone_changing_hands_is_accepted) {
  // A storage records its streams on a tombstone before the late free; the
  // record is accepted whether it finds the orphan or the new pool's. It
  // records over and over until the creation returns, so that some record
  // straddles the hand-off (without the hand-off lock this failed about one
  // run in six: the window is two lookups wide).
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  void* region = dev.allocate_segment(2 * mib);
  for (int round = 0; round < 10000; ++round) {
    void* tombstone = nullptr;
    const auto r = race_a_creation(a, region, 2 * mib, round, [&](void* block, const std::atomic<bool>& created) {
      tombstone = block;
      do {
        a.record_stream(block, {});
      } while (!created);
    });
    if (r.late_error) std::rethrow_exception(r.late_error);
    a.deallocate(tombstone, {});
    a.destroy_private_pool(r.pool);
  }
  a.check_invariants();
  dev.free_segment(region);
}

}  // namespace
}  // namespace shoal::testing
