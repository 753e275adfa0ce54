// An allocator in a fork() child of the process that made it: its cached
// blocks are the parent's (on the host backend their bytes stay shared with
// the parent, which hands them out again), so the child is refused
// allocations, its drops of inherited blocks free nothing, and destroying
// the allocator there gives no memory back.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "support/forwarding_device.h"
#include "support/processes.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

class segment_counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void free_segment(void* base) override {
    ++frees;
    forwarding_device::free_segment(base);
  }
  std::atomic<int> frees{0};
};

TEST(allocator_fork, a_forked_child_is_refused_allocations_and_gives_back_nothing_of_the_parents) {
  backend::host_device host;
  segment_counting_device dev(host);
  auto allocator = std::make_unique<alloc::caching_allocator>(dev, alloc::allocator_config{});
  void* kept = allocator->allocate(4096, {});
  void* cached = allocator->allocate(4096, {});
  allocator->deallocate(cached, {});  // a cached block: the parent may hand it out again
  const std::int64_t allocated = allocator->stats().allocated_bytes.aggregate.current;

  forked_child child([&] {
    try {
      (void)allocator->allocate(4096, {});
      return 1;
    } catch (const device_unavailable&) {
    } catch (...) {
      return 2;
    }
    try {
      allocator->deallocate(kept, {});
    } catch (...) {
      return 3;
    }
    if (allocator->stats().allocated_bytes.aggregate.current != allocated) return 4;
    allocator.reset();
    return dev.frees.load() == 0 ? 0 : 5;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung";
  EXPECT_EQ(*status, 0) << "1: the child was handed a block, 2: refused with another error, 3: its free threw, "
                           "4: its free freed the parent's block, 5: its teardown gave segments back";

  // The parent's allocator is as it was.
  EXPECT_EQ(allocator->allocate(4096, {}), cached);
  allocator->deallocate(cached, {});
  allocator->deallocate(kept, {});
  allocator.reset();
  EXPECT_GT(dev.frees.load(), 0);
}

// A private pool over memory the parent handed in (a borrowed region, say):
// the child's calls on it refuse before the pool's lock — a parent thread
// allocating there may hold it — and its release in the child (an
// adopted_region's end) changes nothing of the parent's.
TEST(allocator_fork, a_forked_child_is_refused_the_parents_private_pools) {
  backend::host_device host;
  alloc::caching_allocator allocator(host, alloc::allocator_config{});
  constexpr std::size_t region_bytes = 4 << 20;
  void* region = host.allocate_segment(region_bytes);
  const alloc::private_pool_id pool = allocator.create_private_pool(region, region_bytes, {});
  const alloc::private_pool_id growing = allocator.create_growing_private_pool();
  const alloc::pool_checkpoint checkpoint = allocator.checkpoint_private_pool(growing);
  forked_child child([&] {
    const auto refused = [](const auto& call) {
      try {
        call();
      } catch (const device_unavailable&) {
        return true;
      } catch (...) {
      }
      return false;
    };
    if (!refused([&] { allocator.drain_private_pool(pool); })) return 1;
    if (!refused([&] { (void)allocator.clear_private_pool(pool); })) return 2;
    if (!refused([&] { (void)allocator.destroy_private_pool(pool); })) return 3;
    if (!refused([&] { (void)allocator.create_private_pool(region, region_bytes, {}); })) return 4;
    if (!refused([&] { allocator.forget_last_streams(pool); })) return 5;
    if (!refused([&] { (void)allocator.private_pool_allocated_blocks(pool); })) return 6;
    if (!refused([&] { (void)allocator.create_growing_private_pool(); })) return 7;
    if (!refused([&] { (void)allocator.checkpoint_private_pool(pool); })) return 8;
    if (!refused([&] { (void)allocator.restore_private_pool(growing, checkpoint); })) return 9;
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung";
  EXPECT_EQ(*status, 0) << "not refused: 1 drain, 2 clear, 3 destroy, 4 a new pool over the parent's memory, "
                           "5 forget_last_streams, 6 the allocated blocks, 7 a growing pool, 8 a checkpoint, "
                           "9 a restore";
  (void)allocator.destroy_private_pool(pool);  // the parent's pools are whole
  (void)allocator.destroy_private_pool(growing);
  host.free_segment(region);
}

}  // namespace
}  // namespace shoal::testing
