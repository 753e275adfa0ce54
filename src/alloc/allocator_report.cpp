// The allocator's reports: statistics, snapshots, the trace, OOM observers.
#include <mutex>
#include <tuple>
#include <utility>

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

// Each counter of a pool and the figure of allocator_stats it adds to.
struct counter_field {
  stat pool_counters::*counter;
  stat_by_pool allocator_stats::*figure;
};
constexpr counter_field counter_fields[] = {
    {&pool_counters::allocations, &allocator_stats::allocations},
    {&pool_counters::segments, &allocator_stats::segments},
    {&pool_counters::active, &allocator_stats::active},
    {&pool_counters::inactive_split, &allocator_stats::inactive_split},
    {&pool_counters::allocated_bytes, &allocator_stats::allocated_bytes},
    {&pool_counters::reserved_bytes, &allocator_stats::reserved_bytes},
    {&pool_counters::active_bytes, &allocator_stats::active_bytes},
    {&pool_counters::inactive_split_bytes, &allocator_stats::inactive_split_bytes},
    {&pool_counters::requested_bytes, &allocator_stats::requested_bytes},
    {&pool_counters::invalidated, &allocator_stats::invalidated},
    {&pool_counters::invalidated_bytes, &allocator_stats::invalidated_bytes},
};

template <class Fn>
void for_each_stat(pool_counters& c, Fn&& fn) {
  for (const counter_field& f : counter_fields) fn(c.*f.counter);
}

void add_counters(allocator_stats& out, pool_kind kind, const pool_counters& c) {
  for (const counter_field& f : counter_fields) accumulate(out.*f.figure, kind, c.*f.counter);
}

// Appends the pool's segments, free blocks shown merged as settling would
// leave them. Holding the pool's lock.
void copy_segments(const block_pool& p, snapshot& out) {
  for (const auto& s : p.segments) {
    segment_snapshot seg;
    seg.address = s->base;
    seg.size = s->size;
    seg.mapped_bytes = s->mapped_bytes;
    seg.pool = p.kind;
    seg.stream = p.stream;
    seg.vacant = p.vacant;
    seg.expandable = s->expandable;
    seg.external = s->external;
    seg.private_pool = s->part_name;
    seg.owner = p.owner;
    seg.sequence = s->sequence;
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
}

}  // namespace

void allocator_core::retire_counters(const block_pool& part) {
  // As if the pool were gone: whatever was current is freed (its memory
  // went back with it).
  pool_counters& into = retired_[static_cast<std::size_t>(part.kind)];
  for (const counter_field& f : counter_fields) {
    const stat& from = part.counters.*f.counter;
    stat& to = into.*f.counter;
    to.allocated += from.allocated;
    to.freed += from.allocated;
    to.peak += from.peak;
  }
  if (!part.grows) retired_region_reserved_peak_ += part.counters.reserved_bytes.peak;
}

allocator_stats allocator_core::stats() {
  allocator_stats out;
  std::lock_guard retired_lock(retired_mutex_);  // no pool's counters move to retired_ meanwhile
  // Private pools' memory is the caller's, outside the source's total
  // (growing ones' excepted: the device's, counted there).
  std::int64_t private_reserved_peak = 0;
  directory_.look_at_each_pool(true, [&](block_pool& p) noexcept {
    if (p.is_private && !p.grows) private_reserved_peak += p.counters.reserved_bytes.peak;
    pool_counters c = p.counters;  // free split blocks counted merged, as settling would leave them
    std::tie(c.inactive_split, c.inactive_split_bytes) = settled_split_stats(p);
    add_counters(out, p.kind, c);
  });
  for (std::size_t k = 0; k < pool_kinds; ++k) add_counters(out, static_cast<pool_kind>(k), retired_[k]);
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
  directory_.look_at_each_pool(true, [](block_pool& p) noexcept {
    for_each_stat(p.counters, [](stat& s) { s.peak = s.current; });
  });
  for (pool_counters& c : retired_) for_each_stat(c, [](stat& s) { s.peak = 0; });
  retired_region_reserved_peak_ = 0;
  source_.reset_reserved_peak();
}

void allocator_core::reset_accumulated_stats() {
  std::lock_guard retired_lock(retired_mutex_);
  directory_.look_at_each_pool(true, [](block_pool& p) noexcept {
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
  // A look, not a take: a monitor taking snapshots now and then costs the
  // allocating threads no bias. A copy that runs out of memory is thrown
  // once every pool is let go.
  directory_.look_at_each_pool_or_throw(true, [&](block_pool& p) { copy_segments(p, out); });
  return out;
}

std::vector<trace_entry> allocator_core::trace() const { return trace_.entries(); }

std::uint64_t allocator_core::add_oom_observer(std::function<void(const oom_report&)> observer) {
  std::lock_guard lock(observers_mutex_);
  observers_.emplace_back(last_observer_id_ + 1, std::move(observer));
  return ++last_observer_id_;
}

bool allocator_core::remove_oom_observer(std::uint64_t id) {
  std::function<void(const oom_report&)> gone;  // destroyed outside the lock: it may hold anything
  std::lock_guard lock(observers_mutex_);
  const auto it = std::ranges::find(observers_, id, &decltype(observers_)::value_type::first);
  if (it == observers_.end()) return false;
  gone = std::move(it->second);
  observers_.erase(it);
  return true;
}

}  // namespace shoal::alloc::detail
