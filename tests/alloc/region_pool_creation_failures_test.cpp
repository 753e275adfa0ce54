// A private pool's creation over a region that runs out of host memory
// midway (each of its heap allocations refused in turn): it throws
// std::bad_alloc and leaves the allocator as it was — no segment of it in
// the directory, its (possibly reused) sub-pools given back empty, the
// region's orphaned tombstones still owed their late frees — and the next
// creation on the region works.
#include <gtest/gtest.h>

#include <cstdint>
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

}  // namespace
}  // namespace shoal::testing
