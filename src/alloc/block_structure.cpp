#include "alloc/block_structure.h"

#include <algorithm>
#include <array>
#include <utility>

#include "alloc/core_util.h"

namespace shoal::alloc::detail {

block* split(block_pool& pool, block* b, std::size_t size) {
  if (b->counted_inactive_split) {  // counted at its old size
    pool_counters::sub(pool.counters.inactive_split, 1);
    pool_counters::sub(pool.counters.inactive_split_bytes, static_cast<std::int64_t>(b->size));
    b->counted_inactive_split = false;
  }
  block* rest = pool.new_block();
  rest->address = b->address + size;
  rest->size = b->size - size;
  rest->owner = b->owner;
  rest->state = block_state::free;
  rest->mapped = b->mapped;
  rest->last_streams = b->last_streams;
  rest->prev = b;
  rest->next = b->next;
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  refresh_split_stat(pool, rest);
  refresh_split_stat(pool, b);
  return rest;
}

block* merge_into(block_pool& pool, block* into, block* gone) {
  // Callers have taken both out of the bins; `gone` directly follows `into`.
  if (gone->counted_inactive_split) {
    pool_counters::sub(pool.counters.inactive_split, 1);
    pool_counters::sub(pool.counters.inactive_split_bytes, static_cast<std::int64_t>(gone->size));
    gone->counted_inactive_split = false;
  }
  if (into->counted_inactive_split) {
    pool_counters::sub(pool.counters.inactive_split, 1);
    pool_counters::sub(pool.counters.inactive_split_bytes, static_cast<std::int64_t>(into->size));
    into->counted_inactive_split = false;
  }
  into->size += gone->size;
  into->next = gone->next;
  if (gone->next != nullptr) gone->next->prev = into;
  for (auto s : gone->last_streams) add_unique(into->last_streams, s);
  into->waits.insert(into->waits.end(), gone->waits.begin(), gone->waits.end());
  gone->waits.clear();
  recycle(pool, gone);
  refresh_split_stat(pool, into);
  return into;
}

void recycle(block_pool& pool, block* b) {
  if (b->counted_inactive_split) {
    pool_counters::sub(pool.counters.inactive_split, 1);
    pool_counters::sub(pool.counters.inactive_split_bytes, static_cast<std::int64_t>(b->size));
  }
  pool.recycle(b);
}

block* settle(block_pool& pool, block* b) {
  b->quick = false;
  if (settled_free(b->prev)) {
    pool.bins.remove(b->prev);
    b = merge_into(pool, b->prev, b);
  }
  if (settled_free(b->next)) {
    pool.bins.remove(b->next);
    b = merge_into(pool, b, b->next);
  }
  pool.bins.insert(b);
  refresh_split_stat(pool, b);
  return b;
}

void settle_quick(block_pool& pool) {
  // One at a time: a block still parked does not merge, so each one is
  // merged only with blocks already settled, and never merged away before
  // its own turn.
  const std::size_t count = std::exchange(pool.quick_count, 0);
  for (std::size_t i = 0; i < count; ++i) settle(pool, pool.quick[i]);
}

block* take_quick(block_pool& pool, std::size_t size) noexcept {
  for (std::size_t i = pool.quick_count; i-- > 0;) {  // newest first
    block* b = pool.quick[i];
    if (b->size == size) {
      pool.quick[i] = pool.quick[--pool.quick_count];
      return b;
    }
  }
  return nullptr;
}

std::pair<stat, stat> settled_split_stats(const block_pool& pool) noexcept {
  stat blocks = pool.counters.inactive_split, bytes = pool.counters.inactive_split_bytes;
  // Settling merges each run of free mapped blocks that holds a parked one
  // into one block: the run's blocks leave the counters, and the merged one
  // joins them if it still shares its segment. Merging only subtracts, so
  // the peaks stay.
  std::array<const block*, block_pool::quick_capacity> runs{};
  std::size_t run_count = 0;
  for (std::size_t i = 0; i < pool.quick_count; ++i) {
    const block* first = pool.quick[i];
    while (merges_with_prev_when_settled(first)) first = first->prev;
    if (std::find(runs.begin(), runs.begin() + static_cast<std::ptrdiff_t>(run_count), first) !=
        runs.begin() + static_cast<std::ptrdiff_t>(run_count)) {
      continue;  // counted from another parked block of the same run
    }
    runs[run_count++] = first;
    const block* last = first;
    std::int64_t run_bytes = static_cast<std::int64_t>(first->size), counted = 0, counted_bytes = 0;
    for (const block* b = first; b != nullptr && (b == first || merges_with_prev_when_settled(b)); b = b->next) {
      last = b;
      if (b != first) run_bytes += static_cast<std::int64_t>(b->size);
      if (b->counted_inactive_split) {
        ++counted;
        counted_bytes += static_cast<std::int64_t>(b->size);
      }
    }
    const bool merged_counts = (first->prev != nullptr || last->next != nullptr) && !first->owner->expandable;
    pool_counters::sub(blocks, counted - (merged_counts ? 1 : 0));
    pool_counters::sub(bytes, counted_bytes - (merged_counts ? run_bytes : 0));
  }
  return {blocks, bytes};
}

}  // namespace shoal::alloc::detail
