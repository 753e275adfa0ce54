#include "alloc/segment_source.h"

#include <algorithm>
#include <array>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

// The whole mappings inside the free block b of growable segment s, from
// its first on, until they hold at least `budget` bytes: [lo, hi), empty
// when none lies wholly inside b.
std::pair<std::uintptr_t, std::uintptr_t> whole_mappings(const segment& s, const block* b, std::size_t granularity,
                                                         std::size_t budget) {
  const std::size_t end = (b->address + b->size - s.base) / granularity;  // slots [.., end) lie inside b
  std::size_t first = (b->address - s.base + granularity - 1) / granularity;
  while (first < end && s.mapping_slots[first] == 0) ++first;  // inside a mapping that began before b
  std::size_t last = first;
  while (last < end && s.mapping_slots[last] != 0 && last + s.mapping_slots[last] <= end &&
         (last - first) * granularity < budget) {
    last += s.mapping_slots[last];
  }
  return {s.base + first * granularity, s.base + last * granularity};
}

// True when a free block of the growable segment holds a whole mapping.
bool has_free_mapping(const segment& s, std::size_t granularity) {
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (!settled_free(b)) continue;
    const auto [lo, hi] = whole_mappings(s, b, granularity, ~std::size_t{0});
    if (hi > lo) return true;
  }
  return false;
}

}  // namespace

std::size_t limit_of(const allocator_config& config, double memory_fraction, backend::device& device) {
  std::size_t limit = config.memory_limit;
  if (memory_fraction > 0) {
    const auto total = static_cast<double>(device.memory().total_bytes);
    limit = std::min(limit, static_cast<std::size_t>(total * memory_fraction));
  }
  return limit;
}

segment_source::segment_source(backend::device& device, const allocator_config& config, pool_directory& directory,
                               trace_ring& trace, const allocator_hooks& hooks, event_pool& events,
                               orphaned_tombstones& orphans, std::mutex& region_handoff)
    : device_(device),
      config_(config),
      directory_(directory),
      trace_(trace),
      hooks_(hooks),
      events_(events),
      orphans_(orphans),
      region_handoff_(region_handoff),
      limit_(limit_of(config, config.memory_fraction, device)),
      mapper_(device) {}

block* segment_source::grow(block_pool& pool, std::size_t size, bool right_sized_allowed) {
  if (pool.is_private && !pool.grows) return nullptr;
  // A growing private pool takes plain segments whatever the setting: a
  // growable range's chunks are unmapped by give-backs, which never touch it.
  if (config_.expandable_segments && !pool.is_private) return grow_expandable(pool, size);
  // A segment over orphaned tombstones keeps them, and its free stretches
  // around them may all be smaller than `size`: it stays (cached, held
  // from this growth's give-backs) while the next is taken, so the device
  // cannot give the same memory again.
  std::array<const segment*, max_segments_over_tombstones> held{};
  for (std::size_t tries = 0; tries < held.size(); ++tries) {
    block* b = grow_plain(pool, size, right_sized_allowed, std::span(held.data(), tries));
    if (b == nullptr || b->size >= size) return b;
    held[tries] = b->owner;
  }
  return nullptr;
}

block* segment_source::grow_plain(block_pool& pool, std::size_t size, bool right_sized_allowed,
                                  std::span<const segment* const> held) {
  // Under a limit or device pressure the standard segment may not fit where
  // the request itself does: a segment of the block's own size is tried
  // when the caller allows it (after giving other pools' caches back).
  std::size_t bytes = segment_size_for(size, config_);
  // The cached segments did not fit: where the new one would raise the
  // reserved peak, wholly free ones go back first (this pool's, then its
  // sibling's), just enough to stay at the peak, so they do not sit in
  // reserved memory beside it. Below the peak they stay: giving them back
  // costs device calls and lowers no peak (docs/architecture.md).
  if (config_.release_idle_before_grow && host_waits_allowed() && over_peak(bytes) > 0) {
    give_back(pool, over_peak(bytes), nullptr, nullptr, held);
    give_back_from_sibling(pool, over_peak(bytes), nullptr);
  }
  // The host memory the new segment's bookkeeping needs comes first, so
  // that std::bad_alloc never strands a segment the device gave.
  auto s = std::make_unique<segment>();
  pool.segments.reserve(pool.segments.size() + 1);
  pool.reserve_blocks(1);
  void* base = take_segment(bytes);
  if (base == nullptr && right_sized_allowed && fallback_segment_size_for(size) < bytes) {
    bytes = fallback_segment_size_for(size);
    base = take_segment(bytes);
  }
  if (base == nullptr) return nullptr;
  s->base = reinterpret_cast<std::uintptr_t>(base);
  s->size = s->mapped_bytes = bytes;
  s->pool = &pool;
  s->sequence = directory_.next_segment_sequence();
  std::vector<std::uintptr_t> covered;
  try {
    // Room for the tombstones of the orphans it covers: two block objects
    // (the tombstone, the free rest after it) and an index entry each, beside
    // the entry the caller reserved for its hand-out. Counted once the device
    // gave the memory: no orphan is added inside it from then on (a pool's
    // region leaves the process before the device can give its address out).
    const std::size_t orphans = orphans_.count_within(s->base, s->base + bytes, min_block);
    if (orphans > 0) {
      covered.resize(orphans);
      pool.reserve_blocks(1 + 2 * orphans);
      pool.by_address.reserve(1 + orphans);
    }
    directory_.register_segment(*s);  // the last step that may throw
  } catch (...) {
    try {
      free_plain_segment(s->base);
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the refusal below is what the caller hears
    }
    unreserve_bytes(bytes);
    throw;
  }
  note_reserved_peak();
  device_allocations_.fetch_add(1, std::memory_order_relaxed);
  block* b = pool.new_block();  // the spare reserved above
  b->address = s->base;
  b->size = bytes;
  b->owner = s.get();
  s->first = b;
  segment& added = *s;
  pool.segments.push_back(std::move(s));  // within the room reserved above
  pool_counters::add(pool.counters.segments, 1);
  pool_counters::add(pool.counters.reserved_bytes, static_cast<std::int64_t>(bytes));
  note_segment(trace_action::segment_alloc, added.base, bytes, pool);
  return keep_orphans_as_tombstones(pool, added, covered);
}

block* segment_source::keep_orphans_as_tombstones(block_pool& pool, segment& s,
                                                  std::span<std::uintptr_t> room) noexcept {
  // The segment is in the directory and its pool's lock held, so a late
  // free that no longer finds the orphan finds the tombstone (it looks
  // again, and waits for this lock: allocator_core::deallocate).
  // Blocks start on the segment's grid of min_block bytes: an orphan off it
  // stays one (no block can start there).
  const std::size_t n = orphans_.take_within(s.base, s.base + s.size, min_block, room);
  block* rest = s.first;
  block* largest = nullptr;
  const auto cache = [&](block* b) {
    pool.bins.insert(b);
    if (largest == nullptr || b->size > largest->size) largest = b;
  };
  for (const std::uintptr_t address : room.first(n)) {
    if (address > rest->address) {
      block* after = split(pool, rest, address - rest->address);
      cache(rest);
      rest = after;
    }
    block* after = rest->size > min_block ? split(pool, rest, min_block) : nullptr;
    rest->state = block_state::invalidated;
    refresh_split_stat(pool, rest);
    pool.by_address.insert(rest);  // within the room reserved by grow_plain
    pool_counters::add(pool.counters.invalidated, 1);
    pool_counters::add(pool.counters.invalidated_bytes, static_cast<std::int64_t>(min_block));
    rest = after;
    if (rest == nullptr) break;
  }
  if (rest != nullptr) cache(rest);
  return largest;
}

void* segment_source::take_segment(std::size_t bytes) {
  if (!reserve_bytes(bytes)) return nullptr;
  try {
    return config_.memory == allocator_memory::pinned_host ? device_.allocate_pinned_host(bytes)
                                                           : device_.allocate_segment(bytes);
  } catch (const out_of_memory&) {
    unreserve_bytes(bytes);
    return nullptr;
  } catch (...) {  // another failure (the host's memory, a device error): nothing was taken
    unreserve_bytes(bytes);
    throw;
  }
}

void segment_source::free_plain_segment(std::uintptr_t base) {
  if (config_.memory == allocator_memory::pinned_host) {
    device_.free_pinned_host(reinterpret_cast<void*>(base));
  } else {
    device_.free_segment(reinterpret_cast<void*>(base));
  }
}

bool segment_source::reserve_growable(block_pool& pool, std::size_t size) {
  // One range as large as the device, so this pool never needs a second. A
  // request past the device's memory could never be mapped: refused before
  // a range of its size (and host memory per chunk of it) is kept for good.
  const std::size_t total = device_.memory().total_bytes;
  if (total > 0 && size > total) return false;
  const std::size_t g = device_.granularity();
  const std::size_t span = round_up(std::max(total, size), g);
  // The host memory it needs comes first, so that std::bad_alloc never
  // strands a range the device reserved.
  auto s = std::make_unique<segment>();
  s->chunks.resize(span / g);
  s->mapping_slots.resize(span / g);
  pool.segments.reserve(pool.segments.size() + 1);
  pool.reserve_blocks(1);
  void* base = reserve_clear_of_orphans(span);
  if (base == nullptr) return false;
  s->base = reinterpret_cast<std::uintptr_t>(base);
  s->size = span;
  s->pool = &pool;
  s->expandable = true;
  s->sequence = directory_.next_segment_sequence();
  try {
    directory_.register_segment(*s);  // the one step after the device's that may throw
  } catch (...) {
    try {
      device_.release_range(base);
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the refusal below is what the caller hears
    }
    throw;
  }
  block* b = pool.new_block();  // the spare reserved above
  b->address = s->base;
  b->size = span;
  b->owner = s.get();
  b->mapped = false;
  s->first = b;
  pool.growable = s.get();
  pool.segments.push_back(std::move(s));  // within the room reserved above
  pool_counters::add(pool.counters.segments, 1);
  return true;
}

void* segment_source::reserve_clear_of_orphans(std::size_t span) {
  // A range over an orphaned tombstone is held while the next is reserved
  // (so the device cannot give the same one), then released: a late free
  // of the tombstone must never find a block of the range at its address.
  std::array<void*, max_ranges_over_tombstones> aside{};
  std::size_t held = 0;
  const auto release_aside = [&] {
    for (std::size_t i = 0; i < held; ++i) {
      try {
        device_.release_range(aside[i]);
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): only address space is lost
      }
    }
  };
  void* base = nullptr;
  try {
    while (held < aside.size()) {
      void* range = device_.reserve_range(span);
      const auto low = reinterpret_cast<std::uintptr_t>(range);
      if (orphans_.count_within(low, low + span, 1) == 0) {
        base = range;
        break;
      }
      aside[held++] = range;
    }
  } catch (const out_of_memory&) {  // NOLINT(bugprone-empty-catch): no range, as when every one lies over one
  } catch (...) {
    release_aside();
    throw;
  }
  release_aside();
  return base;
}

segment_source::stretch segment_source::stretch_for(const segment& s, std::size_t size) const {
  // The unbacked stretch that needs the fewest bytes mapped, counting the
  // free mapped blocks it would join before and after it (the first such).
  const std::size_t g = device_.granularity();
  stretch best;
  for (block* u = s.first; u != nullptr; u = u->next) {
    if (u->mapped) continue;
    const std::size_t before = settled_free(u->prev) ? u->prev->size : 0;
    const std::size_t after = settled_free(u->next) ? u->next->size : 0;
    const auto consider = [&](std::size_t need, bool at_end) {
      if (need <= u->size && (best.u == nullptr || need < best.need)) best = {u, need, at_end};
    };
    const auto beside = [&](std::size_t joined) { return size > joined ? round_up(size - joined, g) : g; };
    consider(beside(before), false);
    if (after > 0) consider(beside(after), true);
    // Mapped whole, the stretch joins both neighbours.
    if (before + u->size + after >= size) consider(u->size, false);
  }
  return best;
}

block* segment_source::grow_expandable(block_pool& pool, std::size_t size) {
  if (pool.growable == nullptr && !reserve_growable(pool, size)) return nullptr;
  segment* s = pool.growable;
  stretch where = stretch_for(*s, size);
  // Free whole chunks that did not fit the request would be reserved beside
  // the new mapping: where that raises the reserved peak, all of them go back
  // first (not the free block the mapping joins), then just enough of the
  // sibling pool's to stay at the peak. Below the peak they stay: giving them
  // back costs device calls and lowers no peak. Giving back only enough of
  // the pool's own was measured erratic (BERT serving swung between 1.003
  // and 1.061 across chunk sizes of 20-28 MiB; all of it moves smoothly
  // with the chunk size): docs/architecture.md. The chunks given back are
  // unmapped but kept, and the new mapping takes them before it creates any
  // (the rest are released): moved rather than released and made again.
  spare_chunks spare;
  if (config_.release_idle_before_grow && host_waits_allowed() && where.u != nullptr && over_peak(where.need) > 0) {
    try {
      give_back(pool, ~std::size_t{0}, where.at_end ? where.u->next : where.u->prev, &spare);
      where = stretch_for(*s, size);
      if (where.u != nullptr) give_back_from_sibling(pool, over_peak(where.need), &spare);
    } catch (...) {
      mapper_.release(spare);
      throw;
    }
  }
  const std::size_t need = where.u != nullptr ? where.need : 0;
  try {
    pool.reserve_blocks(1);  // the split below takes it: nothing after the mapping allocates
  } catch (...) {
    mapper_.release(spare);
    throw;
  }
  if (need == 0 || !reserve_bytes(need)) {
    mapper_.release(spare);
    return nullptr;
  }
  block* u = where.u;
  // The mapping goes at the stretch's start, or at its end to join the block after it.
  const std::uintptr_t at = where.at_end ? u->address + u->size - need : u->address;
  bool mapped = false;
  try {
    mapped = mapper_.map(*s, at, need, spare);
  } catch (...) {  // a device error other than out of memory: nothing was mapped
    unreserve_bytes(need);
    throw;
  }
  if (!mapped) {
    unreserve_bytes(need);
    return nullptr;
  }
  s->mapped_bytes += need;
  note_reserved_peak();
  pool_counters::add(pool.counters.reserved_bytes, static_cast<std::int64_t>(need));
  note_segment(trace_action::segment_map, at, need, pool);
  if (u->size > need) {  // the rest stays unbacked
    block* rest = split(pool, u, at == u->address ? need : u->size - need);
    if (at != u->address) u = rest;
  }
  u->mapped = true;
  return settle(pool, u);
}

void segment_source::release_cached(block_pool& pool) { give_back(pool, ~std::size_t{0}, nullptr, nullptr); }

bool segment_source::release_unmapped_growable(block_pool& pool) {
  segment* s = pool.growable;
  if (s == nullptr) return true;
  block* whole = s->first;
  if (s->mapped_bytes != 0 || whole->next != nullptr || whole->state != block_state::free) return false;
  // The ordering rule (pool_directory.h): out of the directory before the
  // device has the range back.
  auto entry = directory_.take_segment_entry(*s);
  try {
    device_.release_range(reinterpret_cast<void*>(s->base));
  } catch (...) {
    directory_.put_back_segment_entry(std::move(entry));
    throw;
  }
  pool_counters::sub(pool.counters.segments, 1);
  give_back_waits(whole, events_);
  recycle(pool, whole);
  pool.growable = nullptr;
  std::erase_if(pool.segments, [&](const std::unique_ptr<segment>& p) { return p.get() == s; });
  return true;
}

void segment_source::free_detached_segments(private_pool_id pool,
                                            const std::vector<std::pair<std::uintptr_t, std::size_t>>& segments) {
  // Out of the directory already, so nobody can reach them again: each is
  // freed and unreserved whatever an observer or the device says, and the
  // first error goes on afterwards (a failed free's memory is the driver's
  // to lose; counting it reserved would hold the limit against nothing).
  std::exception_ptr first;
  const auto remember = [&] {
    if (!first) first = std::current_exception();
  };
  for (const auto& [base, size] : segments) {
    try {
      hooks_.notify_release(base, size);
    } catch (...) {
      remember();
    }
    note_segment(trace_action::segment_free, base, size, {}, pool);  // before another pool can be given its address
    try {
      free_plain_segment(base);
      device_frees_.fetch_add(1, std::memory_order_relaxed);
    } catch (...) {
      remember();
    }
    {
      std::lock_guard lock(detached_mutex_);
      unreserve_bytes(size);
      detached_bytes_ -= size;
    }
  }
  if (first) std::rethrow_exception(first);
}

void segment_source::note_detached(std::size_t bytes) {
  std::lock_guard lock(detached_mutex_);
  detached_bytes_ += bytes;
}

std::size_t segment_source::reserved_in_pools() const {
  std::lock_guard lock(detached_mutex_);
  return reserved_total() - detached_bytes_;
}

std::size_t segment_source::give_back(block_pool& pool, std::size_t budget, const block* keep, spare_chunks* spare,
                                      std::span<const segment* const> held) {
  if (pool.is_private) return 0;
  settle_quick(pool);
  std::vector<segment*> unused;
  std::size_t unused_bytes = 0;
  // Held from the first segment with tombstones to the end: try_lock, as a
  // pool lock is held here (pool_directory.h); while a late free is between
  // its looks, such segments stay this time.
  std::unique_lock<std::mutex> handoff(region_handoff_, std::defer_lock);
  const bool tombstones_here = pool.counters.invalidated.current > 0;  // else no segment is walked
  for (auto& s : pool.segments) {
    if (unused_bytes >= budget) break;
    if (s->expandable || std::find(held.begin(), held.end(), s.get()) != held.end()) continue;
    const bool unused_but_for_tombstones = tombstones_here && !s->unused() && free_but_for_tombstones(*s);
    if (!s->unused() && !unused_but_for_tombstones) continue;
    if (unused_but_for_tombstones && !handoff.owns_lock() && !handoff.try_lock()) continue;
    unused.push_back(s.get());
    unused_bytes += s->size;
  }
  const bool unmappable =
      unused_bytes < budget && pool.growable != nullptr && has_free_mapping(*pool.growable, device_.granularity());
  if (unused.empty() && !unmappable) return 0;
  // Work already enqueued on the pool's stream may still touch free blocks
  // (the last uses before their frees, debug poison): let it finish first.
  // This waits under the pool's lock, so the stream's other threads wait
  // too; it happens only when memory is given back (empty_cache, out of
  // memory, growth past the peak), and only for pools that have some to give.
  // A vacant pool's last uses have all run (block_pool::vacant).
  if (!pool.vacant) device_.synchronize(pool.stream);
  for (segment* s : unused) release_segment(pool, s);
  return unused_bytes +
         (unmappable ? unmap_free_chunks(pool, pool.growable, budget - unused_bytes, keep, spare) : 0);
}

void segment_source::give_back_from_sibling(block_pool& pool, std::size_t budget, spare_chunks* spare) {
  // try_lock: a pool lock is never waited for while another is held
  // (pool_directory.h); a busy sibling keeps its memory this time.
  if (budget == 0 || pool.sibling == nullptr) return;
  std::unique_lock lock(pool.sibling->lock, std::try_to_lock);
  if (!lock.owns_lock()) return;
  give_back(*pool.sibling, budget, nullptr, spare);  // may throw (a failed stream): the guard unlocks
}

bool segment_source::free_but_for_tombstones(const segment& s) noexcept {
  bool tombstones = false;
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (b->state == block_state::invalidated) {
      tombstones = true;
    } else if (!settled_free(b)) {
      return false;
    }
  }
  return tombstones;
}

void segment_source::release_segment(block_pool& pool, segment* s) {
  // Its tombstones (free_but_for_tombstones) are orphans again while the
  // memory is away: a late free that no longer finds one in the directory
  // finds the orphan, so they are added first (room taken before anything
  // changes). The caller holds the region hand-off lock then: no late free
  // is between its looks meanwhile.
  std::vector<std::uintptr_t> tombstones;
  for (const block* b = s->first; b != nullptr; b = b->next) {
    if (b->state == block_state::invalidated) tombstones.push_back(b->address);
  }
  if (!tombstones.empty()) {
    orphans_.reserve(tombstones.size());
    for (const auto address : tombstones) orphans_.add(address);
  }
  // The ordering rule (pool_directory.h): out of the directory, then the
  // observers (the memory is still there for them to act on), then back to
  // the device — only then can another pool be given the same address.
  directory_.unregister_segment(*s);
  bool told_free = false;
  try {
    hooks_.notify_release(s->base, s->size);
    // Told before the device has it back: from then on another pool may be
    // given the same address and tell its segment_alloc first.
    note_segment(trace_action::segment_free, s->base, s->size, pool);
    told_free = true;
    free_plain_segment(s->base);
  } catch (...) {
    if (told_free) note_segment(trace_action::segment_alloc, s->base, s->size, pool);  // it stayed after all
    directory_.register_segment(*s);  // nothing went back: the segment stays cached as it was
    if (!tombstones.empty()) orphans_.forget_all(tombstones);
    throw;
  }
  unreserve_bytes(s->size);
  device_frees_.fetch_add(1, std::memory_order_relaxed);
  pool_counters::sub(pool.counters.segments, 1);
  pool_counters::sub(pool.counters.reserved_bytes, static_cast<std::int64_t>(s->size));
  for (block* b = s->first; b != nullptr;) {
    block* next = b->next;
    if (b->state == block_state::invalidated) {
      (void)pool.by_address.take(b->address);
      pool_counters::sub(pool.counters.invalidated, 1);
      pool_counters::sub(pool.counters.invalidated_bytes, static_cast<std::int64_t>(b->size));
    } else {
      pool.bins.remove(b);
    }
    if (b->counted_inactive_split) {
      pool_counters::sub(pool.counters.inactive_split, 1);
      pool_counters::sub(pool.counters.inactive_split_bytes, static_cast<std::int64_t>(b->size));
      b->counted_inactive_split = false;
    }
    give_back_waits(b, events_);  // debug mode's hazard events, if it was freed elsewhere
    recycle(pool, b);
    b = next;
  }
  std::erase_if(pool.segments, [&](const std::unique_ptr<segment>& p) { return p.get() == s; });
}

std::size_t segment_source::unmap_free_chunks(block_pool& pool, segment* s, std::size_t budget, const block* keep,
                                              spare_chunks* spare) {
  const std::size_t g = device_.granularity();
  std::size_t unmapped = 0;
  for (block* b = s->first; b != nullptr && unmapped < budget; b = b->next) {
    if (b->state != block_state::free || !b->mapped || b == keep) continue;
    auto [lo, hi] = whole_mappings(*s, b, g, budget - unmapped);
    if (hi <= lo) continue;
    // The head's and the tail's block objects, before anything changes: a
    // split after the unmap must not throw (it would leave `b` out of the
    // bins, marked mapped over unmapped chunks).
    pool.reserve_blocks(2);
    hooks_.notify_release(lo, hi - lo);  // while the chunks are still mapped; may throw, nothing changed yet
    pool.bins.remove(b);
    std::exception_ptr failure;
    try {
      mapper_.unmap(*s, lo, hi, spare);
    } catch (...) {
      // The mappings before the one that failed are gone, the rest stay
      // mapped: what was unmapped is accounted for below as usual, the rest
      // stays a free mapped block, and then the error goes on.
      failure = std::current_exception();
      hi = mapper_.first_mapped(*s, lo, hi);
      if (hi == lo) {
        pool.bins.insert(b);
        std::rethrow_exception(failure);
      }
    }
    const std::size_t bytes = hi - lo;
    unmapped += bytes;
    unreserve_bytes(bytes);
    s->mapped_bytes -= bytes;
    pool_counters::sub(pool.counters.reserved_bytes, static_cast<std::int64_t>(bytes));
    note_segment(trace_action::segment_unmap, lo, bytes, pool);
    // [b: mapped head][hole][mapped tail], heads and tails possibly empty.
    block* hole = lo > b->address ? split(pool, b, lo - b->address) : b;
    if (hi < hole->address + hole->size) {
      block* tail = split(pool, hole, hi - hole->address);
      pool.bins.insert(tail);
      refresh_split_stat(pool, tail);
    }
    if (hole != b) {
      pool.bins.insert(b);
      refresh_split_stat(pool, b);
    }
    hole->mapped = false;
    refresh_split_stat(pool, hole);
    if (hole->prev != nullptr && !hole->prev->mapped) hole = merge_into(pool, hole->prev, hole);
    if (hole->next != nullptr && !hole->next->mapped) hole = merge_into(pool, hole, hole->next);
    b = hole;
    if (failure) std::rethrow_exception(failure);
  }
  return unmapped;
}

void segment_source::set_limit(std::size_t limit) noexcept {
  // Growth racing with this call was admitted under the old limit.
  const std::size_t old = limit_.exchange(limit, std::memory_order_relaxed);
  std::size_t highest = highest_earlier_limit_.load(std::memory_order_relaxed);
  while (old > highest && !highest_earlier_limit_.compare_exchange_weak(highest, old, std::memory_order_relaxed)) {
  }
}

std::size_t segment_source::ceiling() const noexcept {
  return std::max(limit(), highest_earlier_limit_.load(std::memory_order_relaxed));
}

bool segment_source::reserve_bytes(std::size_t bytes) {
  std::size_t now = reserved_total_.load(std::memory_order_relaxed);
  do {
    const std::size_t limit = this->limit();
    if (bytes > limit || now > limit - bytes) return false;
  } while (!reserved_total_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  return true;
}

void segment_source::note_reserved_peak() noexcept {
  const std::size_t now = reserved_total();
  std::size_t peak = reserved_peak_.load(std::memory_order_relaxed);
  while (now > peak && !reserved_peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

std::size_t segment_source::over_peak(std::size_t bytes) const noexcept {
  const std::size_t after = reserved_total() + bytes, peak = reserved_peak();
  return after > peak ? after - peak : 0;
}

void segment_source::reset_reserved_peak() noexcept { reserved_peak_ = reserved_total(); }

void segment_source::note_segment(trace_action action, std::uintptr_t address, std::size_t size,
                                  backend::stream_ref stream, private_pool_id pool) const noexcept {
  if (trace_.enabled()) trace_.note(action, address, size, stream);
  if (hooks_.has_segment_observers()) hooks_.notify_segment({action, address, size, stream, pool});
}

void segment_source::note_segment(trace_action action, std::uintptr_t address, std::size_t size,
                                  const block_pool& pool) const noexcept {
  note_segment(action, address, size, pool.stream, pool.is_private ? pool.owner : private_pool_id{});
}

void segment_source::unreserve_bytes(std::size_t bytes) noexcept {
  reserved_total_.fetch_sub(bytes, std::memory_order_relaxed);
}

void segment_source::reset_device_counters() noexcept {
  device_allocations_ = 0;
  device_frees_ = 0;
  mapper_.reset_counts();
}

void segment_source::release_at_teardown(block_pool& pool, event_pool& events) noexcept {
  // Work still queued may touch the pool's memory: what other streams do
  // before their frees (the pending frees' events) and what the pool's own
  // stream does (last uses, debug poison). Let it finish before the memory
  // goes. The pool's stream is held (pool_directory.h), so it is still
  // there, with its work, even where its owner destroyed it; the streams a
  // private pool's blocks remember were waited for before (held_streams).
  // Awaiting frees (no event) are on the pool's own stream, waited for below.
  for (block* b : pool.pending) {
    for (auto e : b->waits) {
      try {
        device_.synchronize_event(e);
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
      }
      if (!b->wait_shared) events.give_back(e);
    }
    b->waits.clear();
  }
  for (const auto& group : pool.sealed) events.give_back(group.event);  // each shared event once
  pool.sealed.clear();
  pool.awaiting.clear();
  try {
    if (!pool.vacant) device_.synchronize(pool.stream);
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): as above
  }
  for (auto& s : pool.segments) {
    for (block* b = s->first; b != nullptr;) {
      block* next = b->next;
      for (auto e : b->waits) events.give_back(e);
      delete b;
      b = next;
    }
    try {
      if (s->expandable) {
        mapper_.unmap_for_teardown(*s);
        device_.release_range(reinterpret_cast<void*>(s->base));
      } else if (!s->external) {
        free_plain_segment(s->base);
      }
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
    }
  }
}

}  // namespace shoal::alloc::detail
