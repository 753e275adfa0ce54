// The test hook that breaks an invariant on purpose
// (shoal/alloc/invariant_test_hook.h), so tests can see the checker catch it.
#include "shoal/alloc/invariant_test_hook.h"

#include <mutex>
#include <vector>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/size_policy.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/core/error.h"

namespace shoal::alloc {

namespace detail {

void allocator_core::unsafe_break_invariant(void* ptr, test_hook::invariant_breakage what) {
  using test_hook::invariant_breakage;
  if (what == invariant_breakage::vacant_unmarked) {  // no pool lock held here: the directory's comes first
    bool broken = false;
    directory_.with_stream_pools_listed([&](const auto&, const std::vector<stream_pools*>& vacant) {
      if (vacant.empty()) return;
      std::lock_guard lock(vacant.front()->small.lock);
      vacant.front()->small.vacant = false;
      broken = true;
    });
    if (!broken) throw invalid_argument("unsafe_break_invariant: the allocator let no stream go");
    return;
  }
  if (what == invariant_breakage::vacant_block_handed_out) {
    bool broken = false;
    directory_.with_stream_pools_listed([&](const auto&, const std::vector<stream_pools*>& vacant) {
      for (stream_pools* p : vacant) {
        for (block_pool* pool : {&p->small, &p->large}) {
          std::lock_guard lock(pool->lock);
          if (broken || pool->quick_count == 0) continue;
          // What hand_out_parked does (inlined on the hot path, not callable here).
          block* b = pool->quick[--pool->quick_count];
          b->quick = false;
          b->state = block_state::allocated;
          refresh_split_stat(*pool, b);
          count_hand_out(*pool, b, 0);
          broken = true;
        }
      }
    });
    if (!broken) throw invalid_argument("unsafe_break_invariant: no let-go stream's pool holds a parked block");
    return;
  }
  with_block(reinterpret_cast<std::uintptr_t>(ptr), "unsafe_break_invariant", [&](block_pool& pool, block* b) {
    block* next = b->next;
    const bool next_settled = settled_free(next) && next->size >= 2 * min_block;
    switch (what) {
      case invariant_breakage::block_overlap:
        if (next == nullptr) break;
        b->size += min_block;
        return;
      case invariant_breakage::settled_not_in_bins:
        if (!next_settled) break;
        pool.bins.remove(next);
        return;
      case invariant_breakage::free_neighbours:
        if (!next_settled) break;
        pool.bins.remove(next);
        pool.bins.insert(split(pool, next, min_block));
        pool.bins.insert(next);
        return;
      case invariant_breakage::counter:
        pool_counters::add(pool.counters.allocated_bytes, static_cast<std::int64_t>(min_block));
        return;
      case invariant_breakage::unregistered:
        directory_.unregister_segment(*b->owner);
        return;
      case invariant_breakage::out_of_service:
        pool.in_service = false;
        return;
      case invariant_breakage::unnumbered:
        b->owner->sequence = 0;
        return;
      case invariant_breakage::numbered_as_first:
        if (pool.segments.front().get() == b->owner) break;
        b->owner->sequence = pool.segments.front()->sequence;
        return;
      case invariant_breakage::tombstone_unindexed:
        if (b->state != block_state::invalidated) break;
        (void)pool.by_address.take(b->address);
        return;
      case invariant_breakage::free_block_holds_a_recorded_stream:
        if (!next_settled) break;
        next->used_on.push_back(b->stream);
        return;
      case invariant_breakage::vacant_unmarked:
      case invariant_breakage::vacant_block_handed_out:
        break;  // above
    }
    throw invalid_argument("unsafe_break_invariant: the block at " + hex(b->address) +
                           " has no block after it, or not the settled free block of at least 1024 bytes this needs, "
                           "or is not the tombstone this needs, or is in its pool's first segment");
  });
}

}  // namespace detail

void test_hook::unsafe_break_invariant(caching_allocator& allocator, void* ptr, invariant_breakage what) {
  allocator.core_->unsafe_break_invariant(ptr, what);
}

}  // namespace shoal::alloc
