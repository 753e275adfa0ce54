// The block structure of a pool's segments: split, merge, park and settle.
//
// These keep block.h's invariants (blocks tile their segment; no two
// settled free neighbours; a block is in the bins iff it is settled free)
// and the pool's inactive_split counters:
//   counted_inactive_split(b) = b is free, mapped, shares its segment with
//                               another block, and the segment is not growable;
//   counters.inactive_split       = #{b : counted_inactive_split(b)},
//   counters.inactive_split_bytes = sum of their sizes.
// They own no state of their own. Thread-safety: every function runs with
// the pool's lock held.
#pragma once

#include <cstddef>
#include <utility>

#include "alloc/block_pool.h"
#include "alloc/event_pool.h"

namespace shoal::alloc::detail {

/// Whether b's bytes belong in the inactive_split counters now.
[[nodiscard]] inline bool counts_as_inactive_split(const block* b) noexcept {
  return b->state == block_state::free && b->mapped && (b->prev != nullptr || b->next != nullptr) &&
         !b->owner->expandable;
}

/// Brings b's share of the inactive_split counters in line with its state.
[[gnu::always_inline]] inline void refresh_split_stat(block_pool& pool, block* b) noexcept {
  const bool wanted = counts_as_inactive_split(b);
  if (wanted == b->counted_inactive_split) return;
  const auto bytes = static_cast<std::int64_t>(b->size);
  if (wanted) {
    pool_counters::add(pool.counters.inactive_split, 1);
    pool_counters::add(pool.counters.inactive_split_bytes, bytes);
  } else {
    pool_counters::sub(pool.counters.inactive_split, 1);
    pool_counters::sub(pool.counters.inactive_split_bytes, bytes);
  }
  b->counted_inactive_split = wanted;
}

/// Cuts `b` to `size`; returns the new block after it (free, same mapping,
/// not in the bins: the caller places it).
block* split(block_pool& pool, block* b, std::size_t size);
/// Joins `gone`, which directly follows `into`, into it; both are out of
/// the bins. Returns `into`.
block* merge_into(block_pool& pool, block* into, block* gone);
/// Takes back a block object no segment links to any more.
void recycle(block_pool& pool, block* b);
/// Gives the events `b` waits for back to `events` (a shared one stays its
/// group's) and clears them: for a block whose memory leaves the allocator
/// with them unwaited (debug mode's hazard events, cross-stream safety off).
void give_back_waits(block* b, event_pool& events) noexcept;
/// Reserves what settling b (after `more_streams` last streams and
/// `more_waits` waits are added to it) gathers into the block that survives
/// its merges, and room in b for those additions, so that neither they nor
/// settle allocate. May throw std::bad_alloc; changes nothing else.
void make_room_to_settle(block* b, std::size_t more_streams, std::size_t more_waits = 0);
/// Merges b with its settled free neighbours and puts the result in the
/// bins; returns it.
block* settle(block_pool& pool, block* b);
/// Settles every parked block.
void settle_quick(block_pool& pool);
/// Unparks and returns a parked block of exactly `size`, or nullptr.
[[nodiscard]] inline block* take_quick(block_pool& pool, std::size_t size) noexcept {
  for (std::size_t i = pool.quick_count; i-- > 0;) {  // newest first
    block* b = pool.quick[i];
    if (b->size == size) {
      pool.quick[i] = pool.quick[--pool.quick_count];
      return b;
    }
  }
  return nullptr;
}

/// The inactive_split counters (blocks, bytes) as settle_quick would leave
/// them — current, peak, allocated and freed — computed without settling:
/// reports show every free block merged and change nothing (settling moves
/// later allocations).
[[nodiscard]] std::pair<stat, stat> settled_split_stats(const block_pool& pool) noexcept;
/// Whether `b` would have merged into the block before it had every parked
/// block been settled (both free and mapped).
[[nodiscard]] inline bool merges_with_prev_when_settled(const block* b) noexcept {
  const auto free_and_mapped = [](const block* x) { return x->state == block_state::free && x->mapped; };
  return b->prev != nullptr && free_and_mapped(b) && free_and_mapped(b->prev);
}
/// The first block of the run `b` would be part of had every parked block
/// been settled (`b` itself when it would merge with nothing before it).
[[nodiscard]] inline const block* first_of_settled_run(const block* b) noexcept {
  while (merges_with_prev_when_settled(b)) b = b->prev;
  return b;
}
/// The size of the pool's largest free block as settle_quick would leave
/// it (0: none), computed without settling: the largest bin's, or a run of
/// free mapped blocks around a parked one.
[[nodiscard]] std::size_t largest_free_when_settled(const block_pool& pool) noexcept;

}  // namespace shoal::alloc::detail
