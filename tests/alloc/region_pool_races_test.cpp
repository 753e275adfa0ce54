// Private pools over a region, made and destroyed while other threads look
// at the allocator: the invariant checker never sees a half-made or
// half-destroyed pool, and the late free of a block a destroy turned into
// a tombstone is counted exactly once, whichever thread gets there first.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "support/invariants_during.h"

namespace shoal::testing {
namespace {

using alloc::live_blocks;
constexpr std::size_t kib = 1024, mib = kib * kib;

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
      for (volatile int spin = 0; spin < delay * 4; spin = spin + 1) {
      }
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

}  // namespace
}  // namespace shoal::testing
