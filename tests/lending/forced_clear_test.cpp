// A forced clear through adopted_region (alloc::live_blocks::invalidate):
// the next model's turn need not wait for a borrower that forgot a block.
// The block is taken back and reported, its owner's late free frees nothing
// newer, and a forced release gives the region back to the lender.
//
// In-process borrowers: the host backend only (lending_fixture.h).
#include <gtest/gtest.h>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/lending/adopted_region.h"
#include "shoal/lending/borrower.h"
#include "lending/lending_fixture.h"
#include "support/allocators.h"

namespace shoal::testing {
namespace {

template <class Backend>
using forced_clear_of_a_region = lending_test<Backend>;
TYPED_TEST_SUITE(forced_clear_of_a_region, backend_types, backend_names);

TYPED_TEST(forced_clear_of_a_region, takes_a_forgotten_block_back_and_a_forced_release_gives_the_region_back) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  alloc::caching_allocator allocator(dev, {});
  backend::stream s(dev);
  lending::adopted_region region(allocator, b.borrow(4 * mib, "model A"),
                                 {{"parameters", 2 * mib}, {"computation", 2 * mib}});
  const auto allocate = [&](const char* part) {
    alloc::private_pool_scope scope(allocator, region.pool(), part);
    return allocator.allocate(mib, s);
  };
  void* weights = allocate("parameters");
  void* forgotten = allocate("computation");
  EXPECT_THROW((void)region.clear("computation"), invalid_argument) << "refused unless forced";

  const auto taken = region.clear("computation", alloc::live_blocks::invalidate);
  ASSERT_EQ(taken.blocks.size(), 1u);
  EXPECT_EQ(taken.blocks[0].address, reinterpret_cast<std::uintptr_t>(forgotten));
  EXPECT_EQ(taken.bytes, mib);
  void* next = allocate("computation");  // the next batch
  EXPECT_NE(next, forgotten);
  allocator.deallocate(forgotten, s);  // the forgetful owner's late free
  EXPECT_NO_THROW((void)allocator.block_size(next)) << "the late free freed the next batch's block";

  alloc::invalidated_blocks_report released;
  b.give_back(region.release(alloc::live_blocks::invalidate, &released));
  EXPECT_FALSE(region.adopted());
  EXPECT_EQ(released.blocks.size(), 2u) << "the weights and the next batch's block";
  EXPECT_EQ(l.status().lent_bytes, 0u);
  EXPECT_NO_THROW(allocator.deallocate(weights, s)) << "a late free after the region went back frees nothing";
  const auto st = allocator.stats();
  EXPECT_TRUE(nothing_in_use(st));
  EXPECT_EQ(st.invalidated.aggregate.current, 0) << st.to_json();
  EXPECT_NO_THROW(allocator.check_invariants());
}

// A stream destroyed since it last used the memory: the drain of an
// unforced clear would wait for it, a forced one waits for the whole device
// instead, so the escape hatch still opens.
TYPED_TEST(forced_clear_of_a_region, a_stream_destroyed_since_its_last_use_does_not_block_a_forced_clear_or_release) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  borrower b(dev, l.address());
  alloc::caching_allocator allocator(dev, {});
  lending::adopted_region region(allocator, b.borrow(4 * mib, "model A"));
  // A block used and freed on a stream that is then destroyed.
  const auto use_on_a_gone_stream = [&] {
    backend::stream gone(dev);
    alloc::private_pool_scope scope(allocator, region.pool());
    void* p = allocator.allocate(mib, gone);
    allocator.deallocate(p, gone);
    dev.synchronize(gone);
  };
  use_on_a_gone_stream();
  const auto taken = region.clear("", alloc::live_blocks::invalidate);
  EXPECT_TRUE(taken.blocks.empty());
  use_on_a_gone_stream();
  alloc::invalidated_blocks_report released;
  b.give_back(region.release(alloc::live_blocks::invalidate, &released));
  EXPECT_FALSE(region.adopted());
  EXPECT_TRUE(released.blocks.empty());
  EXPECT_EQ(l.status().lent_bytes, 0u);
  EXPECT_NO_THROW(allocator.check_invariants());
}

}  // namespace
}  // namespace shoal::testing
