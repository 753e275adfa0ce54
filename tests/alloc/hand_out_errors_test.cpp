// A hand-out refused host memory for its bookkeeping — room in the pool's
// index of allocated blocks, or a block object for the rest of a split —
// throws std::bad_alloc before it changes anything: the block stays free
// in the bins, so none of the pool's memory is lost and the next allocation
// takes it. (A parked block's hand-out needs neither: no split, and its
// index entry had room when it was counted before its free.)
#include <gtest/gtest.h>

#include <cstdint>
#include <new>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "support/allocators.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20;
// The index starts with 64 slots and grows past half full: the 33rd live
// block of a pool is the first whose hand-out makes it grow.
constexpr int blocks_before_index_growth = 32;

struct refused_hand_out {
  backend::host_device dev{{.capacity_bytes = 64 * mib}};
  alloc::caching_allocator a{dev, alloc::allocator_config{}};
  std::vector<void*> live;

  // Asks for one more 512-byte block with every heap allocation refused,
  // then checks that nothing was lost.
  void check() {
    const auto reserved = a.stats().reserved_bytes.aggregate.current;
    const auto allocations = a.stats().allocations.aggregate.current;
    bool refused = false;
    {
      const refusing_allocations refuse;  // nothing that allocates in here
      try {
        (void)a.allocate(512);
      } catch (const std::bad_alloc&) {
        refused = true;
      }
    }
    ASSERT_TRUE(refused) << "the hand-out needed no memory: the test no longer reaches what it names";
    EXPECT_NO_THROW(a.check_invariants());
    EXPECT_EQ(a.stats().allocations.aggregate.current, allocations) << a.stats().to_json();
    live.push_back(a.allocate(512));  // the refused hand-out's block, still free
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, reserved) << "served from the same segment";
    for (void* p : live) a.deallocate(p);
    a.empty_cache();
    EXPECT_TRUE(nothing_in_use(a.stats()));
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "a block of the segment was lost: it did not go back";
  }
};

TEST(hand_out_errors, a_settled_block_whose_index_entry_finds_no_room_stays_in_the_bins) {
  refused_hand_out t;
  for (int i = 0; i < blocks_before_index_growth; ++i) t.live.push_back(t.a.allocate(512));
  t.check();
}

TEST(hand_out_errors, a_split_with_no_block_object_for_its_rest_leaves_the_block_in_the_bins) {
  refused_hand_out t;
  t.live.push_back(t.a.allocate(512));  // the segment's block split once: no spare block object left
  t.check();
}

}  // namespace
}  // namespace shoal::testing
