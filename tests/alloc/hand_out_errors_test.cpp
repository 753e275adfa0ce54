// A hand-out refused host memory for its bookkeeping — room in the pool's
// index for a block leaving the bins, a block object for the rest of a
// split, room for the rest's last streams in a private pool — throws
// std::bad_alloc before it changes anything: the block stays in the bins,
// so none of the pool's memory is lost and the next allocation takes it. A
// parked block needs none of these.
#include <gtest/gtest.h>

#include <cstdint>
#include <new>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
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
    check_with([this] { return a.allocate(512); });
    a.empty_cache();
    EXPECT_TRUE(nothing_in_use(a.stats()));
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "a block of the segment was lost: it did not go back";
  }

  template <class Allocate>
  void check_with(Allocate allocate) {
    const auto reserved = a.stats().reserved_bytes.aggregate.current;
    const auto allocations = a.stats().allocations.aggregate.current;
    bool refused = false;
    {
      const refusing_allocations refuse;  // nothing that allocates in here
      try {
        (void)allocate();
      } catch (const std::bad_alloc&) {
        refused = true;
      }
    }
    ASSERT_TRUE(refused) << "the hand-out needed no memory: the test no longer reaches what it names";
    EXPECT_NO_THROW(a.check_invariants());
    EXPECT_EQ(a.stats().allocations.aggregate.current, allocations) << a.stats().to_json();
    live.push_back(allocate());  // the refused hand-out's block, still free
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, reserved) << "served from the same memory";
    for (void* p : live) a.deallocate(p);
    live.clear();
  }
};

TEST(hand_out_errors, a_parked_block_is_handed_out_without_any_host_memory) {
  // A pending free parked after the allocated count came back to its peak:
  // its hand-out passes that peak, yet the block never left the index (every
  // block outside the bins is in it, the pending one too), so the hand-out
  // takes no host memory (a noexcept path: an allocation refused in it would
  // end the test) and inserts nothing (a second entry for the block would
  // fail check_invariants' count of the index).
  refused_hand_out t;
  backend::stream other(t.dev);
  for (int i = 0; i < blocks_before_index_growth; ++i) t.live.push_back(t.a.allocate(512));
  void* held = t.live.back();
  t.live.pop_back();
  t.a.record_stream(held, other);
  t.a.deallocate(held);  // pending, for `other`
  t.live.push_back(t.a.allocate(512));  // from the bins: the allocated count is back at its peak
  t.dev.synchronize(other);
  t.a.process_pending_frees();  // `held` is parked now
  void* again = nullptr;
  {
    const refusing_allocations refuse;  // a throw here would end the test
    again = t.a.allocate(512);
  }
  EXPECT_EQ(again, held) << "the parked block is the one handed out";
  t.live.push_back(again);
  EXPECT_NO_THROW(t.a.check_invariants());
  for (void* p : t.live) t.a.deallocate(p);
  t.a.empty_cache();
  EXPECT_TRUE(nothing_in_use(t.a.stats()));
}

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

TEST(hand_out_errors, a_private_pool_split_with_no_room_for_its_rest_s_last_streams_leaves_the_block_in_the_bins) {
  refused_hand_out t;
  void* region = t.dev.allocate_segment(2 * mib);
  const auto pool = t.a.create_private_pool(region, 2 * mib);
  {
    alloc::private_pool_scope scope(t.a, pool);
    // Freed on its stream, the merged block remembers it: a split's rest
    // copies that into a block object that never held a stream.
    t.a.deallocate(t.a.allocate(mib));
    t.check_with([&] { return t.a.allocate(512); });
  }
  EXPECT_NO_THROW(t.a.check_invariants());
  t.a.destroy_private_pool(pool);
  t.dev.free_segment(region);
  EXPECT_TRUE(nothing_in_use(t.a.stats()));
}

}  // namespace
}  // namespace shoal::testing
