#include "alloc/allocator_core.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <sstream>

#include "alloc/size_policy.h"
#include "shoal/error.h"

namespace shoal::alloc::detail {

namespace {

std::atomic<std::uint64_t> next_core_serial{1};

// The pool this thread's allocations from one allocator go to, set by
// private_pool_scope. Empty for almost every thread, so the lookup is free.
struct direction {
  std::uint64_t core;
  block_pool* part;
};
thread_local std::vector<direction> directions;
// How many entries `directions` has: a trivially constructed thread_local,
// so the common "no scope" check costs no thread_local initialization.
thread_local std::size_t direction_count = 0;

// A one-entry cache of the last stream pools this thread used.
struct pools_cache {
  std::uint64_t core = 0;
  void* stream = nullptr;
  stream_pools* pools = nullptr;
};
thread_local pools_cache last_pools;

// Segments whose pools this thread freed into lately: [low, high) -> pool.
struct range_cache {
  struct entry {
    std::uint64_t core = 0;
    std::uintptr_t low = 0, high = 0;
    block_pool* pool = nullptr;
  };
  std::array<entry, 4> entries;
  std::size_t next = 0;
};
thread_local range_cache recent_segments;

std::string hex(std::uintptr_t v) {
  std::ostringstream out;
  out << "0x" << std::hex << v;
  return out.str();
}

constexpr std::uint8_t poison_byte = 0xDB;

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

std::size_t limit_of(const allocator_config& config, backend::device& device) {
  std::size_t limit = config.memory_limit;
  if (config.memory_fraction > 0) {
    const auto total = static_cast<double>(device.memory().total_bytes);
    limit = std::min(limit, static_cast<std::size_t>(total * config.memory_fraction));
  }
  return limit;
}

void add_unique(std::vector<backend::stream_ref>& streams, backend::stream_ref s) {
  if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
}

}  // namespace

block_pool* private_pool::part(const std::string& name) {
  for (auto& p : parts) {
    if (p->part_name == name) return p.get();
  }
  return nullptr;
}

allocator_core::allocator_core(backend::device& dev, allocator_config cfg)
    : device(dev), config(std::move(cfg)), serial_(next_core_serial.fetch_add(1)), limit_(limit_of(config, dev)) {
  if (config.trace_entries > 0) trace_.resize(config.trace_entries);
}

allocator_core::~allocator_core() {
  auto release_all = [&](block_pool& pool) {
    for (block* b : pool.pending) {
      for (auto e : b->waits) return_event(e);
      b->waits.clear();
    }
    for (auto& s : pool.segments) {
      for (block* b = s->first; b != nullptr;) {
        block* next = b->next;
        for (auto e : b->waits) return_event(e);
        delete b;
        b = next;
      }
      try {
        if (s->expandable) {
          const std::size_t g = device.granularity();
          for (std::size_t i = 0; i < s->chunks.size(); ++i) {
            if (s->chunks[i].native == 0) continue;
            device.unmap(reinterpret_cast<void*>(s->base + i * g));
            device.release_physical(s->chunks[i]);
          }
          device.release_range(reinterpret_cast<void*>(s->base));
        } else if (!s->external) {
          device.free_segment(reinterpret_cast<void*>(s->base));
        }
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
      }
    }
  };
  for (auto& [stream, pools] : stream_pools_) {
    release_all(pools->small);
    release_all(pools->large);
  }
  for (auto& [id, pool] : private_pools_) {
    for (auto& part : pool->parts) release_all(*part);
  }
  for (auto& pool : destroyed_pools_) {
    for (auto& part : pool->parts) release_all(*part);
  }
  for (auto e : spare_events_) {
    try {
      device.destroy_event(e);
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): as above
    }
  }
}

// ---- pools -------------------------------------------------------------------

block_pool& allocator_core::pool_for(backend::stream_ref stream, pool_kind kind) {
  if (last_pools.core == serial_ && last_pools.stream == stream.native) return last_pools.pools->of(kind);
  stream_pools* pools = nullptr;
  {
    std::shared_lock lock(directory_mutex_);
    if (auto it = stream_pools_.find(stream.native); it != stream_pools_.end()) pools = it->second.get();
  }
  if (pools == nullptr) {
    std::unique_lock lock(directory_mutex_);
    auto& slot = stream_pools_[stream.native];
    if (!slot) {
      slot = std::make_unique<stream_pools>();
      slot->small.kind = pool_kind::small;
      slot->large.kind = pool_kind::large;
      slot->small.stream = slot->large.stream = stream;
    }
    pools = slot.get();
  }
  last_pools = {serial_, stream.native, pools};
  return pools->of(kind);
}

block_pool* allocator_core::directed_pool() const noexcept {
  if (direction_count == 0) return nullptr;
  for (auto it = directions.rbegin(); it != directions.rend(); ++it) {
    if (it->core == serial_) return it->part;
  }
  return nullptr;
}

block_pool* allocator_core::direct_to(block_pool* part) noexcept {
  block_pool* previous = directed_pool();
  std::erase_if(directions, [&](const direction& d) { return d.core == serial_; });
  if (part != nullptr) directions.push_back({serial_, part});
  direction_count = directions.size();
  return previous;
}

// ---- allocation --------------------------------------------------------------

void* allocator_core::allocate(std::size_t bytes, backend::stream_ref stream) {
  if (bytes == 0) throw invalid_argument("caching_allocator::allocate: size is 0; ask for at least one byte");
  block_pool* directed = directed_pool();
  if (bytes > max_request) out_of_memory_error(directed ? *directed : pool_for(stream, pool_kind::large), bytes, stream);
  const std::size_t size = block_size_for(bytes, config);
  block_pool& pool = directed ? *directed : pool_for(stream, pool_kind_for(size));
  block* b;
  {
    std::lock_guard lock(pool.lock);
    b = try_allocate(pool, size, bytes, stream);
  }
  if (b == nullptr) b = allocate_slow(pool, size, bytes, stream);
  if (b == nullptr) out_of_memory_error(pool, bytes, stream);
  if (!trace_.empty()) note(trace_action::alloc, b->address, b->size, stream);
  return reinterpret_cast<void*>(b->address);
}

block* allocator_core::try_allocate(block_pool& pool, std::size_t size, std::size_t requested, backend::stream_ref stream) {
  // A parked block of exactly the size is as good a fit as any. Otherwise
  // the parked blocks settle first, so best fit sees every free block merged
  // (choosing among unmerged parked blocks was measured to fragment more).
  block* b = take_quick(pool, size);
  if (b == nullptr) {
    if (pool.quick_count > 0) settle_quick(pool);
    b = take_free(pool, size);
  }
  if (b == nullptr && !pool.pending.empty()) {
    collect_pending(pool, false);
    b = take_free(pool, size);
  }
  if (b == nullptr) b = grow(pool, size);
  if (b != nullptr) hand_out(pool, b, size, requested, stream);
  return b;
}

block* allocator_core::allocate_slow(block_pool& pool, std::size_t size, std::size_t requested,
                                     backend::stream_ref stream) {
  retries_.fetch_add(1, std::memory_order_relaxed);
  // 1. Reuse this pool's pending frees now by making its stream wait for
  //    them on the device, instead of taking more device memory.
  {
    std::lock_guard lock(pool.lock);
    if (!pool.pending.empty() && !pool.is_private) {
      collect_pending(pool, true);
      if (block* b = take_free(pool, size)) {
        hand_out(pool, b, size, requested, stream);
        return b;
      }
    }
  }
  // 2. Give every pool's unused cached memory back to the device, retry;
  // 3. then wait on the host for every pending free, give back, retry.
  for (const bool wait_for_pending : {false, true}) {
    for_each_pool([&](block_pool& p) {
      std::vector<backend::event_ref> waits;
      if (wait_for_pending) {
        std::lock_guard lock(p.lock);
        for (block* b : p.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
      }
      for (auto e : waits) device.synchronize_event(e);  // without the lock: this may take long
      std::lock_guard lock(p.lock);
      if (wait_for_pending) collect_pending(p, false);
      release_cached(p);
    });
    std::lock_guard lock(pool.lock);
    if (block* b = try_allocate(pool, size, requested, stream)) return b;
  }
  return nullptr;
}

block* allocator_core::take_free(block_pool& pool, std::size_t size) const {
  block* b = pool.bins.best_fit(size);
  return b != nullptr && fits(b->size, size) ? b : nullptr;
}

bool allocator_core::fits(std::size_t block_size, std::size_t size) const noexcept {
  // Oversize blocks (>= max_split_size) are never split, so one serves a
  // request only if little of it goes unused: no more than a split would
  // have left behind for requests under max_split_size, no more than
  // max_non_split_rounding for larger ones.
  if (block_size < size) return false;
  if (block_size < config.max_split_size) return true;
  const std::size_t waste = block_size - size;
  return size < config.max_split_size ? waste <= small_limit : waste < config.max_non_split_rounding;
}

void allocator_core::hand_out(block_pool& pool, block* b, std::size_t size, std::size_t requested,
                              backend::stream_ref stream) {
  if (!b->waits.empty()) {
    // Debug mode with cross-stream safety off: the free did not wait for the
    // stream it happened on; handing the block out before that stream passed
    // is exactly the race the safe default prevents.
    for (auto e : b->waits) {
      if (!device.query_event(e)) {
        throw ordering_violation("caching_allocator (debug): block " + hex(b->address) + " of " +
                                 std::to_string(b->size) +
                                 " bytes is about to be handed out while a stream that freed it has not passed the "
                                 "free; turn cross_stream_safety back on");
      }
    }
    for (auto e : b->waits) return_event(e);
    b->waits.clear();
  }
  const bool was_parked = std::exchange(b->quick, false);  // take_quick unlinked it
  if (!was_parked) pool.bins.remove(b);
  b->state = block_state::allocated;  // before the split: the rest must not merge back into it
  const bool can_split = pool.kind == pool_kind::small || pool.is_private
                             ? b->size - size >= min_block
                             : size < config.max_split_size && b->size - size > small_limit;
  if (can_split) {
    block* rest = split(pool, b, size);
    // A parked block may border a settled free one, which the rest joins.
    if (was_parked) {
      settle(pool, rest);
    } else {
      pool.bins.insert(rest);
    }
  }
  if (pool.is_private) {
    // A private pool is shared by all streams: the last users of this memory
    // must be passed on the device before the new stream touches it.
    for (auto s : b->last_streams) {
      if (s == stream) continue;
      const backend::event_ref e = take_event();
      device.record(e, s);
      device.wait(stream, e);
      return_event(e);
    }
    b->last_streams.clear();
  }
  b->state = block_state::allocated;
  b->requested = requested;
  b->stream = stream;
  pool.allocated.insert(b);
  refresh_split_stat(pool, b);
  auto& c = pool.counters;
  const auto bytes = static_cast<std::int64_t>(b->size);
  pool_counters::add(c.allocations, 1);
  pool_counters::add(c.allocated_bytes, bytes);
  pool_counters::add(c.active, 1);
  pool_counters::add(c.active_bytes, bytes);
  pool_counters::add(c.requested_bytes, static_cast<std::int64_t>(requested));
}

block* allocator_core::grow(block_pool& pool, std::size_t size) {
  if (pool.is_private) return nullptr;
  if (config.expandable_segments) return grow_expandable(pool, size);
  const std::size_t bytes = segment_size_for(size, config);
  if (!reserve_bytes(bytes)) return nullptr;
  void* base;
  try {
    base = device.allocate_segment(bytes);
  } catch (const out_of_memory&) {
    unreserve_bytes(bytes);
    return nullptr;
  }
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
  register_segment(*s);
  pool.segments.push_back(std::move(s));
  pool_counters::add(pool.counters.segments, 1);
  pool_counters::add(pool.counters.reserved_bytes, static_cast<std::int64_t>(bytes));
  pool.bins.insert(b);
  if (!trace_.empty()) note(trace_action::segment_alloc, b->address, bytes, pool.stream);
  return b;
}

block* allocator_core::grow_expandable(block_pool& pool, std::size_t size) {
  const std::size_t g = device.granularity();
  if (pool.growable == nullptr) {
    // One range as large as the device, so this pool never needs a second.
    const std::size_t span = round_up(std::max(device.memory().total_bytes, size), g);
    void* base;
    try {
      base = device.reserve_range(span);
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
    register_segment(*s);
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
        const backend::physical_ref chunk = device.create_physical(g);
        try {
          device.map(reinterpret_cast<void*>(s->base + i * g), chunk);
        } catch (...) {
          device.release_physical(chunk);
          throw;
        }
        s->chunks[i] = chunk;
      }
    } catch (const out_of_memory&) {
      for (std::size_t k = 0; k < mapped_chunks; ++k) {
        const std::size_t i = first_chunk + k;
        device.unmap(reinterpret_cast<void*>(s->base + i * g));
        device.release_physical(s->chunks[i]);
        s->chunks[i] = {};
      }
      unreserve_bytes(need);
      return nullptr;
    }
    device_allocations_.fetch_add(static_cast<std::int64_t>(need / g), std::memory_order_relaxed);
    s->mapped_bytes += need;
    pool_counters::add(pool.counters.reserved_bytes, static_cast<std::int64_t>(need));
    if (!trace_.empty()) note(trace_action::segment_map, u->address, need, pool.stream);
    if (u->size > need) split(pool, u, need);  // the rest stays unbacked
    u->mapped = true;
    return settle(pool, u);
  }
  return nullptr;
}

void allocator_core::out_of_memory_error(block_pool& pool, std::size_t bytes, backend::stream_ref stream) {
  ooms_.fetch_add(1, std::memory_order_relaxed);
  oom_report report;
  report.requested_bytes = bytes;
  report.stream = stream;
  try {
    report.device_free_bytes = device.memory().free_bytes;
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): the report goes out without it
  }
  for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    report.reserved_bytes += static_cast<std::size_t>(p.counters.reserved_bytes.current);
    report.allocated_bytes += static_cast<std::size_t>(p.counters.allocated_bytes.current);
    report.largest_free_block = std::max(report.largest_free_block, p.bins.largest());
  });
  if (!trace_.empty()) note(trace_action::oom, 0, bytes, stream);
  std::vector<std::function<void(const oom_report&)>> observers;
  {
    std::lock_guard lock(observers_mutex_);
    observers = observers_;
  }
  for (auto& o : observers) o(report);
  std::ostringstream m;
  m << "caching_allocator: out of memory allocating " << bytes << " bytes";
  if (pool.is_private) m << " in private sub-pool '" << pool.part_name << "' (private pools never grow)";
  m << " on " << to_string(device.kind()) << ':' << device.ordinal() << ": the device has " << report.device_free_bytes
    << " bytes free; this allocator holds " << report.reserved_bytes << " bytes reserved, of which "
    << report.allocated_bytes << " are allocated; the largest free cached block is " << report.largest_free_block
    << " bytes";
  if (limit_ != allocator_config::no_limit) m << "; the configured limit is " << limit_ << " bytes";
  m << ". Free memory you hold, lower the request, or raise the limit; expandable_segments:true reduces fragmentation";
  throw out_of_memory(m.str(), bytes);
}

// ---- free ----------------------------------------------------------------------

void allocator_core::deallocate(void* ptr, backend::stream_ref stream) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  with_block<true>(address, "deallocate", [&](block_pool& pool, block* b) {
    const bool other_streams = stream != b->stream || !b->used_on.empty();
    const bool hold = config.cross_stream_safety && other_streams;
    const bool mark_hazard = !config.cross_stream_safety && config.debug && stream != b->stream;
    if (hold || mark_hazard) {
      std::vector<backend::stream_ref> streams;
      if (hold) streams = b->used_on;
      if (stream != b->stream) add_unique(streams, stream);
      std::vector<backend::event_ref> events;
      try {
        for (auto s : streams) {
          events.push_back(take_event());
          device.record(events.back(), s);
        }
      } catch (...) {
        for (auto e : events) return_event(e);
        throw;  // nothing changed: the block goes back to the index
      }
      b->waits = std::move(events);
    }
    auto& c = pool.counters;
    pool_counters::sub(c.allocations, 1);
    pool_counters::sub(c.allocated_bytes, static_cast<std::int64_t>(b->size));
    pool_counters::sub(c.requested_bytes, static_cast<std::int64_t>(b->requested));
    b->requested = 0;
    b->used_on.clear();
    if (!trace_.empty()) note(trace_action::free_requested, address, b->size, stream);
    if (hold) {
      b->state = block_state::pending_free;
      pool.pending.push_back(b);
    } else {
      make_reusable(pool, b);
    }
  });
}

void allocator_core::make_reusable(block_pool& pool, block* b) {
  if (b->state == block_state::pending_free) {
    for (auto e : b->waits) return_event(e);
    b->waits.clear();
  }
  auto& c = pool.counters;
  pool_counters::sub(c.active, 1);
  pool_counters::sub(c.active_bytes, static_cast<std::int64_t>(b->size));
  if (config.debug) device.fill(b->stream, reinterpret_cast<void*>(b->address), poison_byte, b->size);
  if (pool.is_private) add_unique(b->last_streams, b->stream);
  b->state = block_state::free;
  if (!trace_.empty()) note(trace_action::free_completed, b->address, b->size, b->stream);
  // Debug mode and private pools settle every block at once: poison and
  // last-stream bookkeeping want every free block in the bins.
  if (config.debug || pool.is_private || !b->mapped) {
    settle(pool, b);
    return;
  }
  b->quick = true;  // first, so the settling below does not merge it
  if (pool.quick_count == block_pool::quick_capacity) settle_quick(pool);
  pool.quick[pool.quick_count++] = b;
  refresh_split_stat(pool, b);
}

block* allocator_core::settle(block_pool& pool, block* b) {
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

void allocator_core::settle_quick(block_pool& pool) {
  // One at a time: a block still parked does not merge, so each one is
  // merged only with blocks already settled, and never merged away before
  // its own turn.
  const std::size_t count = std::exchange(pool.quick_count, 0);
  for (std::size_t i = 0; i < count; ++i) settle(pool, pool.quick[i]);
}

block* allocator_core::take_quick(block_pool& pool, std::size_t size) noexcept {
  for (std::size_t i = pool.quick_count; i-- > 0;) {  // newest first
    block* b = pool.quick[i];
    if (b->size == size) {
      pool.quick[i] = pool.quick[--pool.quick_count];
      return b;
    }
  }
  return nullptr;
}

void allocator_core::collect_pending(block_pool& pool, bool wait_on_device) {
  std::erase_if(pool.pending, [&](block* b) {
    const bool passed = std::all_of(b->waits.begin(), b->waits.end(), [&](auto e) { return device.query_event(e); });
    if (!passed && !wait_on_device) return false;
    if (!passed) {
      for (auto e : b->waits) device.wait(b->stream, e);
    }
    make_reusable(pool, b);
    return true;
  });
}

void allocator_core::process_pending_frees() {
  for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    collect_pending(p, false);
  });
}

void allocator_core::release_cached(block_pool& pool) {
  settle_quick(pool);
  // Work already enqueued on the pool's stream may still touch free blocks
  // (the last uses before their frees, debug poison): let it finish first.
  if (!pool.is_private && pool.segments.size() > 0) device.synchronize(pool.stream);
  std::vector<segment*> unused;
  for (auto& s : pool.segments) {
    if (s->external) continue;
    if (s->expandable) {
      unmap_free_chunks(pool, s.get());
    } else if (s->unused()) {
      unused.push_back(s.get());
    }
  }
  for (segment* s : unused) release_segment(pool, s);
}

void allocator_core::release_segment(block_pool& pool, segment* s) {
  pool.bins.remove(s->first);
  refresh_split_stat(pool, s->first);
  device.free_segment(reinterpret_cast<void*>(s->base));
  unreserve_bytes(s->size);
  device_frees_.fetch_add(1, std::memory_order_relaxed);
  pool_counters::sub(pool.counters.segments, 1);
  pool_counters::sub(pool.counters.reserved_bytes, static_cast<std::int64_t>(s->size));
  if (!trace_.empty()) note(trace_action::segment_free, s->base, s->size, pool.stream);
  unregister_segment(*s);
  recycle(pool, s->first);
  std::erase_if(pool.segments, [&](const std::unique_ptr<segment>& p) { return p.get() == s; });
}

void allocator_core::unmap_free_chunks(block_pool& pool, segment* s) {
  const std::size_t g = device.granularity();
  for (block* b = s->first; b != nullptr; b = b->next) {
    if (b->state != block_state::free || !b->mapped) continue;
    const std::uintptr_t lo = round_up(b->address, g);
    const std::uintptr_t hi = (b->address + b->size) / g * g;
    if (hi <= lo) continue;
    pool.bins.remove(b);
    for (std::uintptr_t a = lo; a < hi; a += g) {
      const std::size_t i = (a - s->base) / g;
      device.unmap(reinterpret_cast<void*>(a));
      device.release_physical(s->chunks[i]);
      s->chunks[i] = {};
    }
    const std::size_t bytes = hi - lo;
    unreserve_bytes(bytes);
    s->mapped_bytes -= bytes;
    device_frees_.fetch_add(static_cast<std::int64_t>(bytes / g), std::memory_order_relaxed);
    pool_counters::sub(pool.counters.reserved_bytes, static_cast<std::int64_t>(bytes));
    if (!trace_.empty()) note(trace_action::segment_unmap, lo, bytes, pool.stream);
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

void allocator_core::empty_cache() {
  for_each_pool([&](block_pool& p) {
    std::vector<backend::event_ref> waits;
    {
      std::lock_guard lock(p.lock);
      for (block* b : p.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
    }
    for (auto e : waits) device.synchronize_event(e);
    std::lock_guard lock(p.lock);
    collect_pending(p, false);
    release_cached(p);
  });
}

void allocator_core::record_stream(void* ptr, backend::stream_ref stream) {
  with_block<false>(reinterpret_cast<std::uintptr_t>(ptr), "record_stream", [&](block_pool&, block* b) {
    if (stream != b->stream) add_unique(b->used_on, stream);
  });
}

std::size_t allocator_core::block_size(const void* ptr) const {
  std::size_t size = 0;
  with_block<false>(reinterpret_cast<std::uintptr_t>(ptr), "block_size", [&](block_pool&, block* b) { size = b->size; });
  return size;
}

// ---- finding a pointer's block -------------------------------------------------

void throw_not_allocated(std::uintptr_t address, const char* op) {
  throw invalid_argument(std::string("caching_allocator::") + op + "(" + hex(address) +
                         "): not a live pointer this allocator handed out (foreign, interior, or freed already)");
}

block_pool* allocator_core::cached_pool(std::uintptr_t address) const noexcept {
  for (const auto& e : recent_segments.entries) {
    if (e.core == serial_ && address - e.low < e.high - e.low) return e.pool;
  }
  return nullptr;
}

block_pool* allocator_core::directory_pool(std::uintptr_t address) const {
  std::shared_lock lock(segments_mutex_);
  auto it = segments_by_base_.upper_bound(address);
  if (it == segments_by_base_.begin()) return nullptr;
  --it;
  if (address - it->first >= it->second.first) return nullptr;
  auto& slot = recent_segments.entries[recent_segments.next++ % recent_segments.entries.size()];
  slot = {serial_, it->first, it->first + it->second.first, it->second.second};
  return it->second.second;
}

void allocator_core::register_segment(const segment& s) {
  std::unique_lock lock(segments_mutex_);
  segments_by_base_[s.base] = {s.size, s.pool};
}

void allocator_core::unregister_segment(const segment& s) {
  std::unique_lock lock(segments_mutex_);
  segments_by_base_.erase(s.base);
}

// ---- block structure -----------------------------------------------------------

block* allocator_core::split(block_pool& pool, block* b, std::size_t size) {
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

block* allocator_core::merge_into(block_pool& pool, block* into, block* gone) {
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

void allocator_core::recycle(block_pool& pool, block* b) {
  if (b->counted_inactive_split) {
    pool_counters::sub(pool.counters.inactive_split, 1);
    pool_counters::sub(pool.counters.inactive_split_bytes, static_cast<std::int64_t>(b->size));
  }
  pool.recycle(b);
}

// ---- accounting ------------------------------------------------------------------

bool allocator_core::reserve_bytes(std::size_t bytes) {
  std::size_t now = reserved_total_.load(std::memory_order_relaxed);
  do {
    if (bytes > limit_ || now > limit_ - bytes) return false;
  } while (!reserved_total_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  return true;
}

void allocator_core::unreserve_bytes(std::size_t bytes) noexcept {
  reserved_total_.fetch_sub(bytes, std::memory_order_relaxed);
}

backend::event_ref allocator_core::take_event() {
  {
    std::lock_guard lock(events_lock_);
    if (!spare_events_.empty()) {
      const auto e = spare_events_.back();
      spare_events_.pop_back();
      return e;
    }
  }
  return device.create_event();
}

void allocator_core::return_event(backend::event_ref event) noexcept {
  std::lock_guard lock(events_lock_);
  spare_events_.push_back(event);
}

void allocator_core::note(trace_action action, std::uintptr_t address, std::size_t size, backend::stream_ref stream) {
  std::lock_guard lock(trace_mutex_);
  trace_[trace_next_] = trace_entry{action, address, size, stream, now_ns()};
  if (++trace_next_ == trace_.size()) {
    trace_next_ = 0;
    trace_wrapped_ = true;
  }
}

}  // namespace shoal::alloc::detail
