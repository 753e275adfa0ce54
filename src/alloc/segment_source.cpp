#include "alloc/segment_source.h"

#include <algorithm>
#include <memory>

#include "alloc/block_structure.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

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
                               trace_ring& trace, const allocator_hooks& hooks)
    : device_(device),
      config_(config),
      directory_(directory),
      trace_(trace),
      hooks_(hooks),
      limit_(limit_of(config, config.memory_fraction, device)) {}

block* segment_source::grow(block_pool& pool, std::size_t size, bool right_sized_allowed) {
  if (pool.is_private) return nullptr;
  if (config_.expandable_segments) return grow_expandable(pool, size);
  // The cached segments did not fit: wholly free ones go back first, so they
  // do not sit in reserved memory beside the new one (measured on replayed
  // traces: docs/benchmarks.md).
  if (config_.release_idle_before_grow) release_cached(pool);
  // Under a limit or device pressure the standard segment may not fit where
  // the request itself does: a segment of the block's own size is tried
  // when the caller allows it (after giving other pools' caches back).
  std::size_t bytes = segment_size_for(size, config_);
  void* base = take_segment(bytes);
  if (base == nullptr && right_sized_allowed && fallback_segment_size_for(size) < bytes) {
    bytes = fallback_segment_size_for(size);
    base = take_segment(bytes);
  }
  if (base == nullptr) return nullptr;
  device_allocations_.fetch_add(1, std::memory_order_relaxed);
  auto s = std::make_unique<segment>();
  s->base = reinterpret_cast<std::uintptr_t>(base);
  s->size = s->mapped_bytes = bytes;
  s->pool = &pool;
  block* b = pool.new_block();
  b->address = s->base;
  b->size = bytes;
  b->owner = s.get();
  s->first = b;
  directory_.register_segment(*s);
  pool.segments.push_back(std::move(s));
  pool_counters::add(pool.counters.segments, 1);
  pool_counters::add(pool.counters.reserved_bytes, static_cast<std::int64_t>(bytes));
  pool.bins.insert(b);
  if (trace_.enabled()) trace_.note(trace_action::segment_alloc, b->address, bytes, pool.stream);
  return b;
}

void* segment_source::take_segment(std::size_t bytes) {
  if (!reserve_bytes(bytes)) return nullptr;
  try {
    return config_.memory == allocator_memory::pinned_host ? device_.allocate_pinned_host(bytes)
                                                           : device_.allocate_segment(bytes);
  } catch (const out_of_memory&) {
    unreserve_bytes(bytes);
    return nullptr;
  }
}

void segment_source::free_plain_segment(std::uintptr_t base) {
  if (config_.memory == allocator_memory::pinned_host) {
    device_.free_pinned_host(reinterpret_cast<void*>(base));
  } else {
    device_.free_segment(reinterpret_cast<void*>(base));
  }
}

block* segment_source::grow_expandable(block_pool& pool, std::size_t size) {
  const std::size_t g = device_.granularity();
  if (pool.growable == nullptr) {
    // One range as large as the device, so this pool never needs a second.
    const std::size_t span = round_up(std::max(device_.memory().total_bytes, size), g);
    void* base;
    try {
      base = device_.reserve_range(span);
    } catch (const out_of_memory&) {
      return nullptr;
    }
    auto s = std::make_unique<segment>();
    s->base = reinterpret_cast<std::uintptr_t>(base);
    s->size = span;
    s->pool = &pool;
    s->expandable = true;
    s->chunks.resize(span / g);
    block* b = pool.new_block();
    b->address = s->base;
    b->size = span;
    b->owner = s.get();
    b->mapped = false;
    s->first = b;
    directory_.register_segment(*s);
    pool.growable = s.get();
    pool.segments.push_back(std::move(s));
    pool_counters::add(pool.counters.segments, 1);
  }
  segment* s = pool.growable;
  // The first unbacked stretch that, joined to a free mapped block before
  // it, can hold the request.
  for (block* u = s->first; u != nullptr; u = u->next) {
    if (u->mapped) continue;
    const std::size_t before = settled_free(u->prev) ? u->prev->size : 0;
    const std::size_t need = size > before ? round_up(size - before, g) : g;
    if (u->size < need) continue;
    if (!reserve_bytes(need)) return nullptr;
    const std::size_t first_chunk = (u->address - s->base) / g;
    std::size_t mapped_chunks = 0;
    try {
      for (; mapped_chunks < need / g; ++mapped_chunks) {
        const std::size_t i = first_chunk + mapped_chunks;
        const backend::physical_ref chunk = device_.create_physical(g);
        try {
          device_.map(reinterpret_cast<void*>(s->base + i * g), chunk);
        } catch (...) {
          device_.release_physical(chunk);
          throw;
        }
        s->chunks[i] = chunk;
      }
    } catch (const out_of_memory&) {
      for (std::size_t k = 0; k < mapped_chunks; ++k) {
        const std::size_t i = first_chunk + k;
        device_.unmap(reinterpret_cast<void*>(s->base + i * g));
        device_.release_physical(s->chunks[i]);
        s->chunks[i] = {};
      }
      unreserve_bytes(need);
      return nullptr;
    }
    device_allocations_.fetch_add(static_cast<std::int64_t>(need / g), std::memory_order_relaxed);
    s->mapped_bytes += need;
    pool_counters::add(pool.counters.reserved_bytes, static_cast<std::int64_t>(need));
    if (trace_.enabled()) trace_.note(trace_action::segment_map, u->address, need, pool.stream);
    if (u->size > need) split(pool, u, need);  // the rest stays unbacked
    u->mapped = true;
    return settle(pool, u);
  }
  return nullptr;
}

namespace {

// True when a free mapped block of the growable segment covers a whole chunk.
bool has_free_chunk(const segment& s, std::size_t granularity) {
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (settled_free(b) && round_up(b->address, granularity) + granularity <= b->address + b->size) return true;
  }
  return false;
}

}  // namespace

void segment_source::release_cached(block_pool& pool) {
  if (pool.is_private) return;
  settle_quick(pool);
  std::vector<segment*> unused;
  bool unmappable = false;
  for (auto& s : pool.segments) {
    if (s->expandable) {
      unmappable = unmappable || has_free_chunk(*s, device_.granularity());
    } else if (s->unused()) {
      unused.push_back(s.get());
    }
  }
  if (unused.empty() && !unmappable) return;
  // Work already enqueued on the pool's stream may still touch free blocks
  // (the last uses before their frees, debug poison): let it finish first.
  // This waits under the pool's lock, so the stream's other threads wait
  // too; it happens only when memory is given back (empty_cache, out of
  // memory), and only for pools that have some to give.
  device_.synchronize(pool.stream);
  for (segment* s : unused) release_segment(pool, s);
  if (unmappable) unmap_free_chunks(pool, pool.growable);
}

void segment_source::release_segment(block_pool& pool, segment* s) {
  pool.bins.remove(s->first);
  refresh_split_stat(pool, s->first);
  // The ordering rule (pool_directory.h): out of the directory, then the
  // observers (the memory is still there for them to act on), then back to
  // the device — only then can another pool be given the same address.
  directory_.unregister_segment(*s);
  hooks_.notify_release(s->base, s->size);
  free_plain_segment(s->base);
  unreserve_bytes(s->size);
  device_frees_.fetch_add(1, std::memory_order_relaxed);
  pool_counters::sub(pool.counters.segments, 1);
  pool_counters::sub(pool.counters.reserved_bytes, static_cast<std::int64_t>(s->size));
  if (trace_.enabled()) trace_.note(trace_action::segment_free, s->base, s->size, pool.stream);
  recycle(pool, s->first);
  std::erase_if(pool.segments, [&](const std::unique_ptr<segment>& p) { return p.get() == s; });
}

void segment_source::unmap_free_chunks(block_pool& pool, segment* s) {
  const std::size_t g = device_.granularity();
  for (block* b = s->first; b != nullptr; b = b->next) {
    if (b->state != block_state::free || !b->mapped) continue;
    const std::uintptr_t lo = round_up(b->address, g);
    const std::uintptr_t hi = (b->address + b->size) / g * g;
    if (hi <= lo) continue;
    pool.bins.remove(b);
    hooks_.notify_release(lo, hi - lo);  // while the chunks are still mapped
    for (std::uintptr_t a = lo; a < hi; a += g) {
      const std::size_t i = (a - s->base) / g;
      device_.unmap(reinterpret_cast<void*>(a));
      device_.release_physical(s->chunks[i]);
      s->chunks[i] = {};
    }
    const std::size_t bytes = hi - lo;
    unreserve_bytes(bytes);
    s->mapped_bytes -= bytes;
    device_frees_.fetch_add(static_cast<std::int64_t>(bytes / g), std::memory_order_relaxed);
    pool_counters::sub(pool.counters.reserved_bytes, static_cast<std::int64_t>(bytes));
    if (trace_.enabled()) trace_.note(trace_action::segment_unmap, lo, bytes, pool.stream);
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
  }
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

void segment_source::unreserve_bytes(std::size_t bytes) noexcept {
  reserved_total_.fetch_sub(bytes, std::memory_order_relaxed);
}

void segment_source::reset_device_counters() noexcept {
  device_allocations_ = 0;
  device_frees_ = 0;
}

void segment_source::release_at_teardown(block_pool& pool, event_pool& events) noexcept {
  // Work still queued may touch the pool's memory: what other streams do
  // before their frees (the pending frees' events) and what the pool's own
  // stream does (last uses, debug poison). Let it finish before the memory
  // goes. A stream already destroyed has nothing queued that the allocator
  // can wait for (its contract asks streams to outlive their blocks).
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
    device_.synchronize(pool.stream);
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
        const std::size_t g = device_.granularity();
        for (std::size_t i = 0; i < s->chunks.size(); ++i) {
          if (s->chunks[i].native == 0) continue;
          device_.unmap(reinterpret_cast<void*>(s->base + i * g));
          device_.release_physical(s->chunks[i]);
        }
        device_.release_range(reinterpret_cast<void*>(s->base));
      } else if (!s->external) {
        free_plain_segment(s->base);
      }
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
    }
  }
}

}  // namespace shoal::alloc::detail
