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

void give_back_waits(block* b, event_pool& events) noexcept {
  if (!b->wait_shared) {
    for (auto e : b->waits) events.give_back(e);
  }
  b->waits.clear();
  b->wait_shared = false;
}

void make_room_to_settle(block* b, std::size_t more_streams, std::size_t more_waits) {
  block* into = settled_free(b->prev) ? b->prev : b;
  const block* next = settled_free(b->next) ? b->next : nullptr;
  std::size_t streams = b->last_streams.size() + more_streams;
  std::size_t waits = b->waits.size() + more_waits;
  if (into != b) {
    streams += into->last_streams.size();
    waits += into->waits.size();
  }
  if (next != nullptr) {
    streams += next->last_streams.size();
    waits += next->waits.size();
  }
  b->last_streams.reserve(b->last_streams.size() + more_streams);
  b->waits.reserve(b->waits.size() + more_waits);
  into->last_streams.reserve(streams);
  into->waits.reserve(waits);
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
  for (std::size_t i = 0; i < count; ++i) {
    (void)pool.by_address.take(pool.quick[i]->address);  // parked blocks stay indexed until they settle
    settle(pool, pool.quick[i]);
  }
}

namespace {

// One run of free mapped blocks that holds a parked one, as sizes in
// address order: settle_quick merges it into one block.
struct run_model {
  static constexpr std::size_t capacity = 2 * block_pool::quick_capacity + 1;  // settled ones never touch
  std::array<const block*, capacity> blocks{};
  std::array<std::int64_t, capacity> sizes{};
  std::array<bool, capacity> parked{}, alive{};
  std::size_t count = 0;
  bool has_outer_neighbour = false;  // the merged block still shares its segment

  [[nodiscard]] std::size_t index_of(const block* b) const noexcept {
    return static_cast<std::size_t>(std::find(blocks.begin(), blocks.begin() + static_cast<std::ptrdiff_t>(count), b) -
                                    blocks.begin());
  }
  [[nodiscard]] std::size_t neighbour(std::size_t i, int direction) const noexcept {
    for (auto k = static_cast<std::ptrdiff_t>(i) + direction; k >= 0 && static_cast<std::size_t>(k) < count;
         k += direction) {
      if (alive[static_cast<std::size_t>(k)]) return static_cast<std::size_t>(k);
    }
    return count;
  }
  [[nodiscard]] std::size_t alive_count() const noexcept {
    return static_cast<std::size_t>(std::count(alive.begin(), alive.begin() + static_cast<std::ptrdiff_t>(count), true));
  }
};

// What merge_into does to the counters, on the model.
void model_merge(run_model& run, std::size_t into, std::size_t gone, stat& blocks, stat& bytes) noexcept {
  pool_counters::sub(blocks, 1);
  pool_counters::sub(bytes, run.sizes[gone]);
  pool_counters::sub(blocks, 1);
  pool_counters::sub(bytes, run.sizes[into]);
  run.sizes[into] += run.sizes[gone];
  run.alive[gone] = false;
  if (run.alive_count() > 1 || run.has_outer_neighbour) {
    pool_counters::add(blocks, 1);
    pool_counters::add(bytes, run.sizes[into]);
  }
}

}  // namespace

std::pair<stat, stat> settled_split_stats(const block_pool& pool) noexcept {
  stat blocks = pool.counters.inactive_split, bytes = pool.counters.inactive_split_bytes;
  // Each run of free mapped blocks that holds a parked one is replayed on a
  // model, merge by merge in settle_quick's order (parked blocks in turn,
  // each with its settled neighbours, as settle does), so every counter —
  // allocated and freed too, not only current — reads as settling leaves it.
  std::array<const block*, block_pool::quick_capacity> firsts{};
  std::size_t run_count = 0;
  for (std::size_t i = 0; i < pool.quick_count; ++i) {
    const block* first = first_of_settled_run(pool.quick[i]);
    const auto seen = firsts.begin() + static_cast<std::ptrdiff_t>(run_count);
    if (std::find(firsts.begin(), seen, first) != seen) continue;  // replayed from another parked block of the run
    firsts[run_count++] = first;
    if (first->owner->expandable) continue;  // nothing in a growable segment is counted
    run_model run;
    const block* last = first;
    for (const block* b = first; b != nullptr && (b == first || merges_with_prev_when_settled(b)) &&
                                 run.count < run_model::capacity;
         b = b->next) {
      last = b;
      run.blocks[run.count] = b;
      run.sizes[run.count] = static_cast<std::int64_t>(b->size);
      run.parked[run.count] = b->quick;
      run.alive[run.count] = true;
      ++run.count;
    }
    run.has_outer_neighbour = first->prev != nullptr || last->next != nullptr;
    for (std::size_t q = 0; q < pool.quick_count; ++q) {
      std::size_t k = run.index_of(pool.quick[q]);
      if (k == run.count) continue;  // parked in another run
      run.parked[k] = false;
      const std::size_t prev = run.neighbour(k, -1);
      if (prev != run.count && !run.parked[prev]) {
        model_merge(run, prev, k, blocks, bytes);
        k = prev;
      }
      const std::size_t next = run.neighbour(k, +1);
      if (next != run.count && !run.parked[next]) model_merge(run, k, next, blocks, bytes);
    }
  }
  return {blocks, bytes};
}

std::size_t largest_free_when_settled(const block_pool& pool) noexcept {
  std::size_t largest = pool.bins.largest();
  // Settled blocks are never neighbours, so a run around parked blocks
  // holds at most 2 * quick_capacity + 1 blocks.
  for (std::size_t i = 0; i < pool.quick_count; ++i) {
    const block* first = first_of_settled_run(pool.quick[i]);
    std::size_t run = first->size;
    for (const block* b = first->next; b != nullptr && merges_with_prev_when_settled(b); b = b->next) run += b->size;
    largest = std::max(largest, run);
  }
  return largest;
}

}  // namespace shoal::alloc::detail
