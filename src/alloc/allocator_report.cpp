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

template <class Fn>
void for_each_stat(pool_counters& c, Fn&& fn) {
  for (stat* s : {&c.allocations, &c.segments, &c.active, &c.inactive_split, &c.allocated_bytes, &c.reserved_bytes,
                  &c.active_bytes, &c.inactive_split_bytes, &c.requested_bytes, &c.invalidated,
                  &c.invalidated_bytes}) {
    fn(*s);
  }
}

}  // namespace

allocator_stats allocator_core::stats() {
  allocator_stats out;
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
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    for_each_stat(p.counters, [](stat& s) { s.peak = s.current; });
  });
  source_.reset_reserved_peak();
}

void allocator_core::reset_accumulated_stats() {
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    for_each_stat(p.counters, [](stat& s) {
      s.allocated = s.current;  // keeps current = allocated - freed
      s.freed = 0;
    });
  });
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
