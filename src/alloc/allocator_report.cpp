// The allocator's reports: statistics, snapshots, the trace, OOM observers.
#include <mutex>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"

namespace shoal::alloc::detail {

namespace {

// Peaks of a sum over pools are reported as the sum of the pools' peaks, an
// upper bound (the pools peak at different moments). Keeping an exact total
// would make every allocation on every stream update one shared counter,
// which is what stops other allocators from scaling. Reserved bytes are the
// exception: they change only when a pool grows or gives memory back, where
// the segment source already keeps one shared total, and so its exact peak.
void accumulate(stat_by_pool& into, pool_kind kind, const stat& s) {
  for (stat* t : {&into.aggregate, &into.pool[static_cast<std::size_t>(kind)]}) {
    t->current += s.current;
    t->peak += s.peak;
    t->allocated += s.allocated;
    t->freed += s.freed;
  }
}

template <class Counters, class Fn>
void for_each_stat(Counters& c, Fn&& fn) {
  for (auto* s : {&c.allocations, &c.segments, &c.active, &c.inactive_split, &c.allocated_bytes, &c.reserved_bytes,
                  &c.active_bytes, &c.inactive_split_bytes, &c.requested_bytes, &c.invalidated,
                  &c.invalidated_bytes}) {
    fn(*s);
  }
}

// Adds `from` to `into` field by field, as the pool it counted were gone:
// whatever was current is freed (its memory went back with the pool).
void add_retired(stat& into, const stat& from) {
  into.allocated += from.allocated;
  into.freed += from.allocated;
  into.peak += from.peak;
}

}  // namespace

void allocator_core::retire_counters(const block_pool& part) {
  pool_counters& into = retired_[static_cast<std::size_t>(part.kind)];
  const pool_counters& from = part.counters;
  add_retired(into.allocations, from.allocations);
  add_retired(into.segments, from.segments);
  add_retired(into.active, from.active);
  add_retired(into.inactive_split, from.inactive_split);
  add_retired(into.allocated_bytes, from.allocated_bytes);
  add_retired(into.reserved_bytes, from.reserved_bytes);
  add_retired(into.active_bytes, from.active_bytes);
  add_retired(into.inactive_split_bytes, from.inactive_split_bytes);
  add_retired(into.requested_bytes, from.requested_bytes);
  add_retired(into.invalidated, from.invalidated);
  add_retired(into.invalidated_bytes, from.invalidated_bytes);
  if (!part.grows) retired_region_reserved_peak_ += from.reserved_bytes.peak;
}

allocator_stats allocator_core::stats() {
  allocator_stats out;
  std::lock_guard retired_lock(retired_mutex_);  // no pool's counters move to retired_ meanwhile
  // Private pools' memory is the caller's, outside the source's total
  // (growing ones' excepted: the device's, counted there).
  std::int64_t private_reserved_peak = 0;
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    const pool_counters& c = p.counters;
    if (p.is_private && !p.grows) private_reserved_peak += c.reserved_bytes.peak;
    const auto [inactive_split, inactive_split_bytes] = settled_split_stats(p);
    accumulate(out.allocations, p.kind, c.allocations);
    accumulate(out.segments, p.kind, c.segments);
    accumulate(out.active, p.kind, c.active);
    accumulate(out.inactive_split, p.kind, inactive_split);
    accumulate(out.allocated_bytes, p.kind, c.allocated_bytes);
    accumulate(out.reserved_bytes, p.kind, c.reserved_bytes);
    accumulate(out.active_bytes, p.kind, c.active_bytes);
    accumulate(out.inactive_split_bytes, p.kind, inactive_split_bytes);
    accumulate(out.requested_bytes, p.kind, c.requested_bytes);
    accumulate(out.invalidated, p.kind, c.invalidated);
    accumulate(out.invalidated_bytes, p.kind, c.invalidated_bytes);
  });
  for (std::size_t k = 0; k < pool_kinds; ++k) {
    const pool_counters& c = retired_[k];
    const auto kind = static_cast<pool_kind>(k);
    accumulate(out.allocations, kind, c.allocations);
    accumulate(out.segments, kind, c.segments);
    accumulate(out.active, kind, c.active);
    accumulate(out.inactive_split, kind, c.inactive_split);
    accumulate(out.allocated_bytes, kind, c.allocated_bytes);
    accumulate(out.reserved_bytes, kind, c.reserved_bytes);
    accumulate(out.active_bytes, kind, c.active_bytes);
    accumulate(out.inactive_split_bytes, kind, c.inactive_split_bytes);
    accumulate(out.requested_bytes, kind, c.requested_bytes);
    accumulate(out.invalidated, kind, c.invalidated);
    accumulate(out.invalidated_bytes, kind, c.invalidated_bytes);
  }
  private_reserved_peak += retired_region_reserved_peak_;
  out.reserved_bytes.aggregate.peak = static_cast<std::int64_t>(source_.reserved_peak()) + private_reserved_peak;
  out.retries = retries_.load();
  out.ooms = ooms_.load();
  out.device_allocations = source_.device_allocations();
  out.device_frees = source_.device_frees();
  out.vmm_calls = source_.vmm_calls();
  out.expandable_segments_fallback = expandable_segments_fallback;
  return out;
}

void allocator_core::reset_peak_stats() {
  std::lock_guard retired_lock(retired_mutex_);
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    for_each_stat(p.counters, [](stat& s) { s.peak = s.current; });
  });
  for (pool_counters& c : retired_) for_each_stat(c, [](stat& s) { s.peak = 0; });
  retired_region_reserved_peak_ = 0;
  source_.reset_reserved_peak();
}

void allocator_core::reset_accumulated_stats() {
  std::lock_guard retired_lock(retired_mutex_);
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    for_each_stat(p.counters, [](stat& s) {
      s.allocated = s.current;  // keeps current = allocated - freed
      s.freed = 0;
    });
  });
  for (pool_counters& c : retired_) for_each_stat(c, [](stat& s) { s.allocated = s.freed = 0; });
  retries_ = 0;
  ooms_ = 0;
  source_.reset_device_counters();
}

snapshot allocator_core::take_snapshot() {
  snapshot out;
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    for (const auto& s : p.segments) {
      segment_snapshot seg;
      seg.address = s->base;
      seg.size = s->size;
      seg.mapped_bytes = s->mapped_bytes;
      seg.pool = p.kind;
      seg.stream = p.stream;
      seg.expandable = s->expandable;
      seg.external = s->external;
      seg.private_pool = s->part_name;
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (!b->mapped) continue;  // unbacked stretches of growable segments hold nothing
        if (merges_with_prev_when_settled(b)) {  // shown as settling would leave it
          seg.blocks.back().size += b->size;
          continue;
        }
        seg.blocks.push_back({b->address, b->size, b->requested, b->state});
      }
      out.segments.push_back(std::move(seg));
    }
  });
  return out;
}

std::vector<trace_entry> allocator_core::trace() const { return trace_.entries(); }

void allocator_core::add_oom_observer(std::function<void(const oom_report&)> observer) {
  std::lock_guard lock(observers_mutex_);
  observers_.push_back(std::move(observer));
}

}  // namespace shoal::alloc::detail
