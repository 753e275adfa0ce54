// A forced clear's tombstone outlives its destroyed private pool as an
// orphan until its owner's late free. Should the device give the region's
// address to a new segment of the same allocator first (the region's memory
// left the process, the address is free again), that segment keeps the
// tombstone, so no newer block starts there and the late free frees nothing
// newer, yet the tombstone alone does not keep the segment reserved; a
// growable range over one is not used at all.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/alloc/late_free_test_hook.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "support/forwarding_device.h"

namespace shoal::testing {
namespace {

using alloc::live_blocks;
using alloc::test_hook::late_free_step;
constexpr std::size_t kib = 1024, mib = kib * kib;

// Hands the allocator, once, an address the test gave up (as a device does
// with memory freed a moment before); the rest goes to the host device.
class reusing_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void reuse_segment(void* base, std::size_t bytes) { segment_ = {base, bytes}; }
  void reuse_range(void* base, std::size_t bytes) { range_ = {base, bytes}; }
  void* allocate_segment(std::size_t bytes) override {
    if (segment_.first != nullptr && bytes == segment_.second) {
      reused_segment = true;
      return std::exchange(segment_.first, nullptr);
    }
    return forwarding_device::allocate_segment(bytes);
  }
  void* reserve_range(std::size_t bytes) override {
    if (range_.first != nullptr && bytes == range_.second) {
      reused_range = true;
      return std::exchange(range_.first, nullptr);
    }
    return forwarding_device::reserve_range(bytes);
  }
  void release_range(void* base) override {
    released_ranges.push_back(base);
    forwarding_device::release_range(base);
  }
  [[nodiscard]] backend::memory_info memory() const override {
    auto m = forwarding_device::memory();
    if (total_bytes != 0) m.total_bytes = total_bytes;
    return m;
  }

  std::size_t total_bytes = 0;  // the device's size the allocator sees (0: the host's)
  bool reused_segment = false, reused_range = false;
  std::vector<void*> released_ranges;

 private:
  std::pair<void*, std::size_t> segment_{nullptr, 0}, range_{nullptr, 0};
};

bool inside(const void* p, const void* base, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p), b = reinterpret_cast<std::uintptr_t>(base);
  return a >= b && a < b + bytes;
}

// A private pool over `region` whose first block a forced destroy takes:
// returns that block's address, an orphaned tombstone from then on.
void* orphan_at_start_of(alloc::caching_allocator& a, void* region, std::size_t bytes) {
  const auto pool = a.create_private_pool(region, bytes);
  void* stale = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    stale = a.allocate(4 * kib, {});
  }
  EXPECT_EQ(stale, region);
  EXPECT_EQ(a.destroy_private_pool(pool, live_blocks::invalidate).blocks.size(), 1u);
  return stale;
}

// An allocator whose device gives its next segment of `bytes` at the address
// of a region that a destroyed private pool left an orphan at the start of.
struct segment_over_an_orphan {
  explicit segment_over_an_orphan(std::size_t bytes)
      : region(host.allocate_segment(bytes)), stale(orphan_at_start_of(a, region, bytes)) {
    dev.reuse_segment(region, bytes);
  }
  backend::host_device host;
  reusing_device dev{host};
  alloc::caching_allocator a{dev, alloc::allocator_config{}};
  void* region;
  void* stale;  // the taken block's address: its late free is owed
};

TEST(orphans_in_new_segments, a_new_segment_at_a_taken_blocks_address_keeps_its_tombstone) {
  segment_over_an_orphan over(2 * mib);  // the small pool's next segment
  auto& [host, dev, a, region, stale] = over;
  void* newer = a.allocate(4 * kib, {});
  ASSERT_TRUE(dev.reused_segment) << "the test's premise: the new segment lies at the region's address";
  EXPECT_NE(newer, stale) << "a newer block starts where a taken block did";
  EXPECT_TRUE(inside(newer, region, 2 * mib)) << "the segment around the tombstone serves it";
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 1) << "the orphan is a tombstone again";
  EXPECT_NO_THROW(a.check_invariants());

  EXPECT_NO_THROW(a.deallocate(stale, {})) << "the owner's late free";
  EXPECT_NO_THROW((void)a.block_size(newer)) << "the late free freed the newer block";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1);
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 0);
  EXPECT_THROW(a.deallocate(stale, {}), invalid_argument) << "a second late free is an unknown pointer";
  a.deallocate(newer, {});
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "the segment went back once wholly free";
  EXPECT_NO_THROW(a.check_invariants());
}

// The late free may never come (the owner leaked the pointer): the tombstone
// does not keep its segment reserved; it goes back an orphan again.
TEST(orphans_in_new_segments, a_segment_kept_only_by_a_tombstone_goes_back_and_the_tombstone_is_an_orphan_again) {
  segment_over_an_orphan over(2 * mib);
  auto& [host, dev, a, region, stale] = over;
  void* newer = a.allocate(4 * kib, {});
  ASSERT_TRUE(dev.reused_segment);
  a.deallocate(newer, {});
  a.empty_cache();
  const auto st = a.stats();
  EXPECT_EQ(st.reserved_bytes.aggregate.current, 0) << "the tombstone kept its segment: " << st.to_json();
  EXPECT_EQ(st.invalidated.aggregate.current, 0);
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_NO_THROW(a.deallocate(stale, {})) << "the late free finds the orphan";
  EXPECT_THROW(a.deallocate(stale, {}), invalid_argument) << "a second late free is an unknown pointer";
}

// A growing private pool's new segment keeps an orphan as a tombstone too; a
// restore of the pool's layout refuses while it lies there (a block could
// start at its address) and changes nothing, and goes ahead after the late free.
TEST(orphans_in_new_segments, a_growing_pools_restore_waits_for_the_late_free_of_a_tombstone_in_its_memory) {
  segment_over_an_orphan over(2 * mib);
  auto& [host, dev, a, region, stale] = over;
  const auto pool = a.create_growing_private_pool();
  const auto saved = a.checkpoint_private_pool(pool);  // nothing yet
  void* newer = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    newer = a.allocate(4 * kib, {});
  }
  ASSERT_TRUE(dev.reused_segment) << "the test's premise: the pool's segment lies at the region's address";
  ASSERT_EQ(a.stats().invalidated.aggregate.current, 1);
  EXPECT_THROW(a.restore_private_pool(pool, saved), invalid_argument);
  EXPECT_NO_THROW((void)a.block_size(newer)) << "nothing changed";
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 1);
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(stale, {});  // the owner's late free
  const auto result = a.restore_private_pool(pool, saved);
  EXPECT_EQ(result.freed, std::vector{reinterpret_cast<std::uintptr_t>(newer)});
  EXPECT_NO_THROW(a.check_invariants());
  a.destroy_private_pool(pool);
}

TEST(orphans_in_new_segments, a_request_no_stretch_around_the_tombstone_fits_takes_another_segment) {
  segment_over_an_orphan over(20 * mib);
  auto& [host, dev, a, region, stale] = over;
  void* newer = a.allocate(20 * mib, {});  // a segment of its own size
  ASSERT_TRUE(dev.reused_segment);
  EXPECT_FALSE(inside(newer, region, 20 * mib)) << "20 MiB less the tombstone's 512 bytes cannot hold it";
  const auto st = a.stats();
  EXPECT_EQ(st.segments.aggregate.current, 2) << "the one over the tombstone stays cached: " << st.to_json();
  EXPECT_EQ(st.invalidated.aggregate.current, 1);
  EXPECT_EQ(st.retries, 0) << "the growth went on to the next segment, not to the out-of-memory steps "
                              "(which give every pool's cached memory back)";
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_NO_THROW(a.deallocate(stale, {}));
  EXPECT_NO_THROW((void)a.block_size(newer));
  void* within = a.allocate(20 * mib - 512, {});
  EXPECT_TRUE(inside(within, region, 20 * mib)) << "the late free made that segment one free block again";
  a.deallocate(within, {});
  a.deallocate(newer, {});
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
  EXPECT_NO_THROW(a.check_invariants());
}

TEST(orphans_in_new_segments, a_growable_range_over_a_taken_blocks_address_is_not_used) {
  backend::host_device host;
  reusing_device dev(host);
  dev.total_bytes = 64 * mib;  // a growable range spans the device: 64 MiB here
  alloc::allocator_config config;
  config.expandable_segments = true;
  alloc::caching_allocator a(dev, config);
  const std::size_t span = 64 * mib;
  void* range = host.reserve_range(span);
  const auto chunk = host.create_physical(2 * mib);
  host.map(range, chunk);
  void* stale = orphan_at_start_of(a, range, 2 * mib);
  host.unmap(range);
  host.release_physical(chunk);
  dev.reuse_range(range, span);
  void* newer = a.allocate(4 * kib, {});
  ASSERT_TRUE(dev.reused_range) << "the test's premise: the device offered the region's range first";
  EXPECT_FALSE(inside(newer, range, span)) << "the range over the orphan was used";
  EXPECT_NE(std::find(dev.released_ranges.begin(), dev.released_ranges.end(), range), dev.released_ranges.end())
      << "the range over the orphan went back once another was reserved";
  EXPECT_NO_THROW(a.deallocate(stale, {})) << "the late free finds the orphan";
  EXPECT_NO_THROW((void)a.block_size(newer));
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1);
  a.deallocate(newer, {});
  EXPECT_NO_THROW(a.check_invariants());
}

// Sets the late free hook for a test's lifetime.
class late_free_hook {
 public:
  explicit late_free_hook(std::function<void(late_free_step)> hook) {
    alloc::test_hook::set_late_free_hook(std::move(hook));
  }
  ~late_free_hook() { alloc::test_hook::set_late_free_hook({}); }
  late_free_hook(const late_free_hook&) = delete;
  late_free_hook& operator=(const late_free_hook&) = delete;
};

// Runs `work` on another thread and waits for it: the freeing thread holds
// the region hand-off lock, which the other thread's give-back tries.
void on_another_thread(const std::function<void()>& work) { std::thread(work).join(); }

// A growth that takes the orphan between the late free's look under the
// lock and its look among the orphans: the free's last look finds the
// tombstone the new segment keeps.
TEST(orphans_in_new_segments, a_late_free_finds_the_tombstone_a_growth_made_of_its_orphan_between_its_looks) {
  segment_over_an_orphan over(2 * mib);
  auto& [host, dev, a, region, stale] = over;
  void* newer = nullptr;
  const late_free_hook hook([&](late_free_step step) {
    if (step == late_free_step::before_orphans && newer == nullptr) {
      on_another_thread([&] { newer = a.allocate(4 * kib, {}); });
    }
  });
  EXPECT_NO_THROW(a.deallocate(stale, {})) << "the late free missed the tombstone";
  ASSERT_TRUE(dev.reused_segment) << "the test's premise: the growth's segment lies over the orphan";
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 0) << "the tombstone stayed";
  EXPECT_NO_THROW((void)a.block_size(newer));
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(newer, {});
}

// Then, before the last look, a give-back of that segment (free but for the
// tombstone) would turn the tombstone back into an orphan, which the free
// no longer looks for: the give-back leaves such a segment while a late free
// holds the hand-off lock.
TEST(orphans_in_new_segments, a_give_back_leaves_a_tombstone_alone_while_a_late_free_is_between_its_looks) {
  segment_over_an_orphan over(2 * mib);
  auto& [host, dev, a, region, stale] = over;
  const late_free_hook hook([&](late_free_step step) {
    on_another_thread([&] {
      if (step == late_free_step::before_orphans) a.deallocate(a.allocate(4 * kib, {}), {});
      if (step == late_free_step::before_last_look) a.empty_cache();
    });
  });
  EXPECT_NO_THROW(a.deallocate(stale, {})) << "the tombstone went back to the orphans between the free's looks";
  ASSERT_TRUE(dev.reused_segment);
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 0);
  EXPECT_NO_THROW(a.check_invariants());
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "the segment goes back once the free is done";
}

}  // namespace
}  // namespace shoal::testing
