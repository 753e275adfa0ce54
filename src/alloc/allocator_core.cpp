#include "alloc/allocator_core.h"

#include <algorithm>
#include <bit>
#include <exception>
#include <sstream>

#include "alloc/awaiting_frees.h"
#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/invariant_checker.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

bool library_checks_every_step() noexcept { return check_every_step; }

namespace {

// The settings that cannot work, refused before anything is built: a limit
// below the smallest segment (no allocation could ever succeed), a
// max_split_size no larger than a large request's segment (the rest of each
// new one would be oversize: kept whole, and serving only requests within
// 1 MiB of it, so nearly every request took a new segment), and those that
// do not apply to pinned host memory.
allocator_config checked(allocator_config config) {
  if (config.max_split_size <= large_segment) {
    throw invalid_argument("caching_allocator: max_split_size_mb " + std::to_string(config.max_split_size >> 20) +
                           " is not more than " + std::to_string(large_segment >> 20) +
                           " MiB, the segment a large request gets: the rest of each would be too large to split, "
                           "and nearly every request would take a new segment (PyTorch refuses it too)");
  }
  if (config.memory_limit < small_segment) {
    throw invalid_argument("caching_allocator: the memory limit (" + std::to_string(config.memory_limit) +
                           " bytes) is below " + std::to_string(small_segment >> 20) +
                           " MiB, the least memory any allocation reserves: none could succeed; set "
                           "memory_limit_mb to at least " + std::to_string(small_segment >> 20));
  }
  if (config.trace_entries > allocator_config::max_trace_entries) {
    throw invalid_argument("caching_allocator: trace_entries " + std::to_string(config.trace_entries) +
                           " is more than the most kept, " + std::to_string(allocator_config::max_trace_entries) + " (" +
                           std::to_string(allocator_config::max_trace_entries * sizeof(trace_entry) >> 20) +
                           " MiB of host memory, taken when the allocator is made)");
  }
  // As parse refuses them: a count that is no power of two rounds sizes off
  // the 512-byte grid every block keeps (a config built as a struct skips parse).
  for (const std::uint32_t n : config.roundup_power2_divisions) {
    if (n != 0 && (n > 64 || !std::has_single_bit(n))) {
      throw invalid_argument("caching_allocator: roundup_power2_divisions " + std::to_string(n) +
                             " is not a power of two from 1 to 64 (or 0)");
    }
  }
  if (config.memory == allocator_memory::pinned_host) {
    if (config.expandable_segments) {
      throw invalid_argument("caching_allocator: memory:pinned_host has no growable segments; leave "
                             "expandable_segments off");
    }
    if (config.memory_fraction > 0) {
      throw invalid_argument("caching_allocator: memory:pinned_host is host memory, not a share of the device; "
                             "bound it with memory_limit_mb instead of memory_fraction");
    }
  }
  return config;
}

// The settings in force: expandable_segments off where the device's lack of
// growable ranges makes plain segments serve it (`fall_back`).
allocator_config effective(allocator_config config, bool fall_back) {
  if (fall_back) config.expandable_segments = false;
  return config;
}

}  // namespace

allocator_core::allocator_core(backend::device& dev, allocator_config cfg)
    : device(dev),
      expandable_segments_fallback(cfg.expandable_segments && !dev.growable().supported),
      config(effective(checked(std::move(cfg)), expandable_segments_fallback)),
      directory_(dev),
      held_streams_(dev),
      trace_(config.trace_entries),
      events_(dev),
      source_(dev, config, directory_, trace_, hooks, events_, orphans_, region_handoff_mutex_) {}

allocator_core::~allocator_core() {
  // In a fork() child the segments and the streams with work on them are
  // the parent's: nothing to wait for or give back here.
  if (epoch_.forked_since()) return;
  // The streams a private pool's blocks remember may still use its memory
  // (each pool waits for its own stream below).
  held_streams_.synchronize_all();
  // Blocks still live at the end (their frees never came): the streams
  // record_stream noted on them are waited for and let go.
  directory_.for_each_pool_ever([&](block_pool& pool) {
    std::lock_guard lock(pool.lock);
    for (const auto& seg : pool.segments) {
      for (block* b = seg->first; b != nullptr; b = b->next) {
        for (const backend::stream_ref s : b->used_on) {
          try {
            device.synchronize(s);
          } catch (...) {  // NOLINT(bugprone-empty-catch): failed work reads nothing more
          }
        }
        let_used_on_go(b);
      }
    }
  });
  directory_.for_each_pool_ever([&](block_pool& pool) { source_.release_at_teardown(pool, events_); });
  directory_.release_stream_holds();  // last: the pools above synchronized their streams
  held_streams_.release_all();
}

void allocator_core::check_invariants() const {
  check_allocator_invariants(directory_, source_, orphans_, config.expandable_segments ? device.granularity() : 0);
}

void throw_not_allocated(std::uintptr_t address, const char* op) {
  throw invalid_argument(std::string("caching_allocator::") + op + "(" + hex(address) +
                         "): not a live pointer this allocator handed out (foreign, interior, or freed already)");
}

void require_not_invalidated(const block* b, const char* op) {
  if (b->state != block_state::invalidated) return;
  throw invalid_argument(std::string("caching_allocator::") + op + "(" + hex(b->address) +
                         "): the block was taken back by a forced clear of its private pool "
                         "(live_blocks::invalidate); only its free is still accepted");
}

namespace {

[[noreturn]] [[gnu::cold]] void throw_forked_allocate(std::size_t bytes) {
  throw device_unavailable("caching_allocator::allocate(" + std::to_string(bytes) +
                           " bytes): this allocator was made in the parent process, and this is a fork() child; its "
                           "blocks are the parent's. Start child processes with spawn or forkserver, or make the "
                           "allocator, and the process's first use of its device, only after fork() (from Python: "
                           "the first shoal call, which makes the default allocator)");
}

}  // namespace

void refuse_in_fork_child(const shoal::detail::fork_epoch& epoch, const char* op) {
  if (!epoch.forked_since()) [[likely]] return;
  throw device_unavailable(std::string("caching_allocator::") + op +
                           ": this allocator was made in the parent process, and this is a fork() child; its "
                           "blocks and pools are the parent's (see allocate)");
}

// ---- allocation --------------------------------------------------------------

void* allocator_core::allocate(std::size_t bytes, backend::stream_ref stream, bool claim) {
  if (epoch_.forked_since()) [[unlikely]] throw_forked_allocate(bytes);
  // The common case, on its own: no private_pool_scope, the stream this
  // thread used last, and a block of the size it freed lately (parked). A
  // miss there goes on to the general steps under the same lock.
  if (bytes - 1 < max_request && thread_cache::direction_count == 0) [[likely]] {  // bytes in [1, max_request]
    if (stream_pools* pools = directory_.cached_pools(stream)) {
      const std::size_t size = block_size_for(bytes, config);
      block_pool& pool = pools->of(pool_kind_for(size));
      block* b;
      {
        const biased_lock_guard lock(pool.lock);
        b = take_quick(pool, size);
        if (b != nullptr) [[likely]] hand_out_parked(pool, b, bytes, stream, claim);
      }
      // The rest out of line, so that this path saves few registers.
      if (b == nullptr) [[unlikely]] return allocate_from(pool, {size, bytes, stream, claim, 0});
      if (trace_.enabled()) trace_.note(trace_action::alloc, b->address, b->size, stream);
      check_step();
      return reinterpret_cast<void*>(b->address);
    }
  }
  return allocate_general(bytes, stream, claim);
}

void* allocator_core::allocate_general(std::size_t bytes, backend::stream_ref stream, bool claim) {
  if (bytes == 0) throw invalid_argument("caching_allocator::allocate: size is 0; ask for at least one byte");
  // An owner destroyed a stream this allocator holds since the last look:
  // it may be let go now (a new stream's first allocation comes here), or a
  // stream skipped before may be looked at again.
  if (sweep_due()) [[unlikely]] let_destroyed_streams_go(false);
  const pool_direction directed = directed_pool();
  // Past any pool: reported against the stream's (a scope's sub-pool is
  // not locked here, and may be stale).
  if (bytes > max_request) out_of_memory_error(directory_.pool_for(stream, pool_kind::large), bytes, stream);
  const std::size_t size = block_size_for(bytes, config);
  if (directed.part != nullptr) directory_.hold_stream_for_private_blocks(stream);  // its blocks will remember it
  block_pool& pool = directed.part != nullptr ? *directed.part : directory_.pool_for(stream, pool_kind_for(size));
  return allocate_from(pool, {size, bytes, stream, claim, directed.generation});
}

void* allocator_core::allocate_from(block_pool& pool, const request& r) {
  const bool hooks_first = first_try_leaves_growth_to_hooks();
  block* b;
  {
    std::lock_guard lock(pool.lock);
    b = try_allocate(pool, r, hooks_first ? growth::none : growth::standard_segment);
  }
  if (b == nullptr) b = allocate_after_miss(pool, r, hooks_first);
  check_step();
  // Traced where it was handed out, under the pool's lock: a forced clear
  // may take the block back from here on (its tombstone keeps the address,
  // not the size).
  return reinterpret_cast<void*>(b->address);
}

bool allocator_core::first_try_leaves_growth_to_hooks() const noexcept {
  // Miss hooks and the slow path may wait on the host: not in a
  // no_host_waits_scope, where a miss growth cannot serve is out of memory.
  return host_waits_allowed() && hooks.has_miss_hooks();
}

block* allocator_core::allocate_after_miss(block_pool& pool, const request& r, bool hooks_first) {
  block* b = nullptr;
  if (hooks_first) {
    // A cache miss: hooks (e.g. limbo collection) may give blocks back
    // before the device is asked. They run with no allocator lock held.
    hooks.run_miss_hooks();
    std::lock_guard lock(pool.lock);
    b = try_allocate(pool, r, growth::standard_segment);
  }
  if (b == nullptr && host_waits_allowed()) b = allocate_slow(pool, r);
  if (b == nullptr) out_of_memory_error(pool, r.requested, r.stream);
  return b;
}

block* allocator_core::try_allocate(block_pool& pool, const request& r, growth may_grow) {
  // Stream pools are always in service, at generation 0.
  if (!pool.in_service || pool.service_generation != r.generation) [[unlikely]] {
    throw invalid_argument(
        "caching_allocator::allocate: this thread's private_pool_scope outlived its private pool (it was destroyed); "
        "end the scope before destroying the pool");
  }
  // A parked block of exactly the size is as good a fit as any. Otherwise
  // the parked blocks settle first, so best fit sees every free block merged
  // (choosing among unmerged parked blocks was measured to fragment more).
  // The common case first: a block this stream freed lately, of the size
  // (still in the index: nothing to make room for).
  if (block* b = take_quick(pool, r.size)) [[likely]] {
    hand_out_parked(pool, b, r.requested, r.stream, r.claim);
    if (trace_.enabled()) trace_.note(trace_action::alloc, b->address, b->size, r.stream);
    return b;
  }
  // Host memory a hand-out may need is taken before a block leaves the
  // bins, so that std::bad_alloc leaves every block where it was: room in
  // the index, and a block object for a split's rest.
  pool.by_address.reserve_one();
  pool.reserve_blocks(1);
  if (pool.quick_count > 0) settle_quick(pool);  // take_cached's steps, its quick look just done
  block* b = take_free(pool, r.size);
  if (b == nullptr && !pool.pending.empty()) {
    // Blocks whose frees completed are parked as they become reusable:
    // looking only in the bins here would miss them, and growth would then
    // give their segment back just to take a new one. The pool's stream is
    // in use here, so its awaiting frees may be sealed (awaiting_frees.h).
    seal_awaiting(pool, device, events_);
    collect_pending(pool, false);
    b = take_cached(pool, r.size);
  }
  if (b == nullptr && may_grow != growth::none) {
    b = source_.grow(pool, r.size, may_grow == growth::right_sized_allowed);
    if (b != nullptr) pool.reserve_blocks(1);  // growth may have used the spare; its block is in the bins
  }
  if (b != nullptr) hand_out(pool, b, r);
  return b;
}

block* allocator_core::allocate_slow(block_pool& pool, const request& r) {
  retries_.fetch_add(1, std::memory_order_relaxed);
  // 1. Reuse this pool's pending frees now by making its stream wait for
  //    them on the device, instead of taking more device memory.
  {
    std::lock_guard lock(pool.lock);
    // Not for pinned host memory: a GPU-side wait does not hold back the CPU.
    if (!pool.pending.empty() && !pool.is_private && config.memory == allocator_memory::device) {
      pool.by_address.reserve_one();  // the hand-out below cannot throw (as in try_allocate)
      pool.reserve_blocks(1);
      collect_pending(pool, true);
      if (block* b = take_cached(pool, r.size)) {
        hand_out(pool, b, r);
        return b;
      }
    }
  }
  // 2. Give every pool's unused cached memory back to the device, retry;
  // 3. then wait on the host for every pending free, give back, retry.
  // A right-sized segment (smaller than the standard one) is allowed from
  // step 2 on: made earlier, it would take memory that giving the cache back
  // provides for the standard segment.
  for (const bool wait_for_pending : {false, true}) {
    if (wait_for_pending) {
      if (block* b = wait_for_own_pending(pool, r)) return b;
      directory_.for_each_pool([&](block_pool& p) {
        std::vector<backend::event_ref> waits;
        {
          std::lock_guard lock(p.lock);
          // The asking stream's pools, both size classes (awaiting_frees.h): a
          // small block's free awaiting in the other would otherwise stay
          // held, and its segment reserved, however long this waits.
          if (&p == &pool || &p == pool.sibling) seal_awaiting(p, device, events_);
          for (block* b : p.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
        }
        for (auto e : waits) device.synchronize_event(e);  // without the lock: this may take long
        std::lock_guard lock(p.lock);
        collect_pending(p, false);
      });
      // What the wait freed is tried before any cache is given back: at a
      // limit, giving it back only to take it again would cost two device
      // calls per allocation (pinned staging blocks hit this in a loop).
      std::lock_guard lock(pool.lock);
      if (block* b = try_allocate(pool, r, growth::none)) return b;
    }
    directory_.for_each_pool([&](block_pool& p) {
      std::lock_guard lock(p.lock);
      source_.release_cached(p);
    });
    std::lock_guard lock(pool.lock);
    if (block* b = try_allocate(pool, r, growth::right_sized_allowed)) return b;
  }
  return nullptr;
}

block* allocator_core::wait_for_own_pending(block_pool& pool, const request& r) {
  // Oldest first, one free at a time: the oldest is usually enough, and
  // waiting for every pending free would drain the stream (a staging ring at
  // its limit would stop overlapping the CPU's copies with the device's).
  for (;;) {
    std::vector<backend::event_ref> waits;
    {
      std::lock_guard lock(pool.lock);
      seal_awaiting(pool, device, events_);  // the stream asking (awaiting_frees.h)
      collect_pending(pool, false);
      if (block* b = try_allocate(pool, r, growth::none)) return b;
      // None left, or the oldest has nothing to wait for (an awaiting free
      // of another stream): the wait for everything follows.
      if (pool.pending.empty() || pool.pending.front()->waits.empty()) return nullptr;
      waits = pool.pending.front()->waits;
    }
    for (auto e : waits) device.synchronize_event(e);  // without the lock: this may take long
  }
}

block* allocator_core::take_cached(block_pool& pool, std::size_t size) {
  if (block* b = take_quick(pool, size)) return b;
  if (pool.quick_count > 0) settle_quick(pool);
  return take_free(pool, size);
}

block* allocator_core::take_free(block_pool& pool, std::size_t size) const {
  block* b = pool.bins.best_fit(size);
  return b != nullptr && fits(b->size, size, splits_oversize(pool.kind, pool.is_private, config), config) ? b : nullptr;
}

SHOAL_HOT_INLINE void allocator_core::hand_out_parked(block_pool& pool, block* b, std::size_t requested,
                                                      backend::stream_ref stream, bool claim) noexcept {
  // What hand_out does, less what cannot apply to a parked block: only
  // stream pools park (no last streams to wait for), a parked block waits
  // for nothing (make_reusable gave its events back), and it has exactly
  // the size asked for (nothing to split off).
  b->quick = false;
  b->state = block_state::allocated;
  b->requested = requested;
  b->stream = stream;
  b->claimed = claim;  // parked blocks stay in the index: nothing to insert
  refresh_split_stat(pool, b);
  count_hand_out(pool, b, requested);
}

void allocator_core::hand_out(block_pool& pool, block* b, const request& r) {
  if (pool.is_private) {
    // A split's rest copies the last streams: room for them in the block
    // object it will take (the spare try_allocate kept), before anything
    // changes, so that std::bad_alloc loses no block.
    if (pool.spare != nullptr) pool.spare->last_streams.reserve(b->last_streams.size());
    // A private pool is shared by all streams: the last users of this memory
    // must be passed on the device before the new stream touches it. First,
    // while nothing has changed: a device call that throws (a last stream
    // destroyed since) leaves the block free where it was.
    for (auto s : b->last_streams) {
      if (s == r.stream) continue;
      const backend::event_ref e = events_.take();
      try {
        device.record(e, s);
        device.wait(r.stream, e);
      } catch (...) {
        events_.give_back(e);
        throw;
      }
      events_.give_back(e);
    }
  }
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
    for (auto e : b->waits) events_.give_back(e);
    b->waits.clear();
  }
  // A parked block (take_quick unlinked it) has exactly the size: no split.
  const bool was_parked = std::exchange(b->quick, false);
  if (!was_parked) pool.bins.remove(b);
  b->state = block_state::allocated;  // before the split: the rest must not merge back into it
  if (can_split(b->size, r.size, pool.kind, pool.is_private, config)) pool.bins.insert(split(pool, b, r.size));
  if (pool.is_private) b->last_streams.clear();  // waited for above
  b->state = block_state::allocated;
  b->requested = r.requested;
  b->stream = r.stream;
  b->claimed = r.claim;  // false after every free (deallocate clears it)
  if (!was_parked) pool.by_address.insert(b);  // a parked block never left it
  refresh_split_stat(pool, b);
  count_hand_out(pool, b, r.requested);
  if (trace_.enabled()) trace_.note(trace_action::alloc, b->address, b->size, r.stream);
}

void allocator_core::out_of_memory_error(block_pool& pool, std::size_t bytes, backend::stream_ref stream) {
  ooms_.fetch_add(1, std::memory_order_relaxed);
  oom_report report;
  report.requested_bytes = bytes;
  report.limit_bytes = source_.limit();
  report.stream = stream;
  try {
    report.device_free_bytes = device.memory().free_bytes;
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): the report goes out without it
  }
  std::size_t largest_here = 0;  // in the pool the request draws from: all it could have used
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    report.reserved_bytes += static_cast<std::size_t>(p.counters.reserved_bytes.current);
    report.allocated_bytes += static_cast<std::size_t>(p.counters.allocated_bytes.current);
    // Parked blocks counted merged, as largest_free_block() counts them.
    const std::size_t largest = largest_free_when_settled(p);
    report.largest_free_block = std::max(report.largest_free_block, largest);
    if (&p == &pool) largest_here = largest;
  });
  if (trace_.enabled()) trace_.note(trace_action::oom, 0, bytes, stream);
  std::vector<std::function<void(const oom_report&)>> observers;
  {
    std::lock_guard lock(observers_mutex_);
    observers.reserve(observers_.size());
    for (const auto& [id, observer] : observers_) observers.push_back(observer);
  }
  // An observer that allocates and runs out of memory itself is not called
  // again for that (it would recurse until the stack gives out).
  thread_local bool observing = false;
  if (!observing) {
    observing = true;
    try {
      for (auto& o : observers) o(report);
    } catch (...) {
      observing = false;
      throw;
    }
    observing = false;
  }
  std::ostringstream m;
  m << "caching_allocator: out of memory allocating " << bytes << " bytes";
  if (pool.is_private) {
    m << " in private sub-pool '" << pool.part_name << "'";
    if (!pool.grows) m << " (a region handed in: private pools over one never grow)";
  }
  m << " on " << to_string(device.kind()) << ':' << device.ordinal() << ": the device has " << report.device_free_bytes
    << " bytes free; this allocator holds " << report.reserved_bytes << " bytes reserved, of which "
    << report.allocated_bytes << " are allocated; the largest free cached block is " << report.largest_free_block
    << " bytes, " << largest_here << " in the " << (pool.kind == pool_kind::small ? "small" : "large")
    << " pool this request draws from";
  if (bytes <= max_request) m << " (as a block of " << block_size_for(bytes, config) << " bytes)";
  if (report.limit_bytes != allocator_config::no_limit) {
    m << "; the configured limit is " << report.limit_bytes << " bytes";
  }
  m << ". Free memory you hold, lower the request, or raise the limit";
  if (!config.expandable_segments) m << "; expandable_segments:true reduces fragmentation";
  throw out_of_memory(m.str(), bytes);
}

// ---- free ----------------------------------------------------------------------

SHOAL_HOT_INLINE bool allocator_core::is_common_free(const block* b, backend::stream_ref stream) const noexcept {
  return b->state == block_state::allocated && b->stream == stream && b->used_on.empty() &&
         config.memory == allocator_memory::device;
}

SHOAL_HOT_INLINE bool allocator_core::parks_without_a_call(const block_pool& pool, const block* b) const noexcept {
  return !settles_at_once(pool, b) && pool.quick_count < block_pool::quick_capacity && !trace_.enabled();
}

SHOAL_HOT_INLINE void allocator_core::free_common(block_pool& pool, block* b) {
  prepare_free(pool, b);  // may throw: nothing has changed yet
  count_free(pool, b);
  if (trace_.enabled()) trace_.note(trace_action::free_requested, b->address, b->size, b->stream);
  make_free(pool, b);
}

bool allocator_core::deallocate(void* ptr, backend::stream_ref stream, bool events_allowed) {
  // A fork() child's drop of a block it inherited: the memory is the parent's.
  if (epoch_.forked_since()) [[unlikely]] return true;
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  // The common free that parks its block, in the pool this thread's cache
  // names, inline; any other free of a block found there allocated or a
  // tombstone, out of line under the same lock (one look-up). The rest takes
  // the general way: a block of another pool, an orphaned tombstone's late
  // free, an unknown pointer, a block found pending or parked (a double free).
  if (block_pool* pool = directory_.cached_pool(address)) [[likely]] {
    enum class outcome : unsigned char { not_here, freed, refused } done = outcome::not_here;
    {
      const biased_lock_guard lock(pool->lock);
      block* b = pool->in_service ? pool->by_address.find(address) : nullptr;
      if (b != nullptr && is_common_free(b, stream) && parks_without_a_call(*pool, b)) [[likely]] {
        // free_common, less what cannot apply: no preparation (it settles
        // nothing), no trace, room in the quick list.
        count_free(*pool, b);
        count_reusable(*pool, b);
        b->state = block_state::free;
        park(*pool, b);
        done = outcome::freed;
      } else if (b != nullptr && (b->state == block_state::allocated || b->state == block_state::invalidated)) {
        done = free_found(*pool, b, stream, events_allowed) ? outcome::freed : outcome::refused;
      }
    }
    if (done != outcome::not_here) [[likely]] {
      check_step();
      return done == outcome::freed;
    }
  }
  return deallocate_general(address, stream, events_allowed);
}

bool allocator_core::free_found(block_pool& pool, block* b, backend::stream_ref stream, bool events_allowed) {
  if (is_common_free(b, stream)) {
    free_common(pool, b);
    return true;
  }
  return free_waiting(pool, b, stream, events_allowed);
}

bool allocator_core::deallocate_general(std::uintptr_t address, backend::stream_ref stream, bool events_allowed) {
  bool freed = true;
  const auto free_block = [&](block_pool& pool, block* b) { freed = free_found(pool, b, stream, events_allowed); };
  if (!run_on_block(address, free_block)) {
    // The late free of a tombstone whose pool was destroyed: nothing to
    // free, unless a pool made on its region since holds it again.
    std::lock_guard handoff(region_handoff_mutex_);
    if (!run_on_block(address, free_block)) {
      run_late_free_hook(test_hook::late_free_step::before_orphans);
      if (orphans_.forget(address)) {
        note_tombstone_removed(address, stream);
      } else {
        // Neither: a new segment may have made the orphan its tombstone since
        // the look above, under its pool's lock, which this look waits for.
        run_late_free_hook(test_hook::late_free_step::before_last_look);
        if (!run_on_block(address, free_block)) throw_not_allocated(address, "deallocate");
      }
    }
  }
  check_step();
  return freed;
}

bool allocator_core::free_waiting(block_pool& pool, block* b, backend::stream_ref stream, bool events_allowed) {
  const auto address = b->address;
  if (b->state == block_state::invalidated) {
    remove_tombstone(pool, b, stream);
    return true;
  }
  const bool freed_elsewhere = stream != b->stream;
  // record_stream's streams are waited for in every mode; the freeing
  // stream only with cross-stream safety on (off is PyTorch's rule, where
  // record_stream is the one protection), or to catch a hazard in debug.
  // Pinned host memory is held after every free, on its own stream too:
  // the next user writes it from the CPU, outside stream order.
  const bool host_written = config.memory == allocator_memory::pinned_host;
  const bool hold = !b->used_on.empty() || (config.cross_stream_safety && freed_elsewhere) || host_written;
  const bool mark_hazard = !config.cross_stream_safety && config.debug && freed_elsewhere;
  // A pinned block freed on its own stream waits for an event it shares
  // with the frees around it (awaiting_frees.h), recorded later.
  const bool awaits = host_written && !freed_elsewhere && b->used_on.empty() && !pool.is_private;
  if (!events_allowed && (hold || mark_hazard)) return false;  // refused: nothing happened to it
  // Everything that may throw comes first, undone on a throw: then nothing
  // has changed. A held block stays in the index while it is pending.
  if (hold) pool.pending.push_back(b);
  std::vector<backend::event_ref> events;
  try {
    if (awaits) make_room_to_await(pool);
    if ((hold || mark_hazard) && !awaits) {
      std::vector<backend::stream_ref> streams = b->used_on;
      if ((freed_elsewhere && (config.cross_stream_safety || mark_hazard)) || host_written) add_unique(streams, stream);
      // Pinned memory freed on another stream: the CPU's next write must wait
      // for the block's own stream's work too (record_stream skips that stream).
      if (host_written) add_unique(streams, b->stream);
      events.reserve(streams.size());
      for (auto s : streams) {
        events.push_back(events_.take());
        device.record(events.back(), s);
      }
    }
    // Last: a refused record leaves the block's memory unpoisoned. Room for
    // the waits it will carry into a merge.
    if (!hold) prepare_free(pool, b, events.size());
    b->waits.reserve(events.size());
  } catch (...) {
    for (auto e : events) events_.give_back(e);
    if (hold) pool.pending.pop_back();
    throw;
  }
  b->waits.assign(events.begin(), events.end());  // within the room reserved above
  let_used_on_go(b);  // their events are recorded: the free needs the streams no more
  count_free(pool, b);
  if (trace_.enabled()) trace_.note(trace_action::free_requested, address, b->size, stream);
  if (hold) {
    b->state = block_state::pending_free;
    note_free_wait({free_wait_event::action::held, address, b->size, b->stream});
    if (awaits) await_free(pool, b, device, events_);
  } else {
    make_reusable(pool, b);
  }
  return true;
}

void allocator_core::free_idle(block_pool& pool, block* b, backend::stream_ref stream) {
  prepare_free(pool, b, 0);  // may throw: nothing has changed yet
  let_used_on_go(b);
  count_free(pool, b);
  if (trace_.enabled()) trace_.note(trace_action::free_requested, b->address, b->size, stream);
  make_free(pool, b);
}

void allocator_core::let_used_on_go(block* b) noexcept {
  for (const backend::stream_ref s : b->used_on) {
    if (s.is_default()) continue;
    try {
      device.release_stream(s);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a refused destroy of the stream; nothing of the block's
    }
  }
  b->used_on.clear();
}

SHOAL_HOT_INLINE void allocator_core::count_free(block_pool& pool, block* b) noexcept {
  auto& c = pool.counters;
  pool_counters::sub(c.allocations, 1);
  pool_counters::sub(c.allocated_bytes, static_cast<std::int64_t>(b->size));
  b->used_on.clear();
  b->held_outside = false;
  b->claimed = false;
  ++pool.frees;
}

void allocator_core::make_reusable(block_pool& pool, block* b) {
  if (b->state != block_state::pending_free) {
    make_free(pool, b);
    return;
  }
  if (std::exchange(b->wait_shared, false)) {
    release_shared_wait(pool, b->waits.front(), events_);
  } else {
    for (auto e : b->waits) events_.give_back(e);
  }
  b->waits.clear();
  const free_wait_event over{free_wait_event::action::completed, b->address, b->size, b->stream};
  make_free(pool, b);  // may settle b into a neighbour: the event was taken first
  note_free_wait(over);
}

SHOAL_HOT_INLINE void allocator_core::prepare_free(block_pool& pool, block* b, std::size_t more_waits) {
  // Only blocks that settle at once (see make_free) need anything.
  if (config.debug || pool.is_private || !b->mapped) [[unlikely]] prepare_settling_free(pool, b, more_waits);
}

void allocator_core::prepare_settling_free(block_pool& pool, block* b, std::size_t more_waits) {
  if (config.debug) {
    // Queued work on the pool's memory, as a free's last uses are: a forced
    // clear that waited for the device before it waits again (frees).
    device.fill(b->stream, reinterpret_cast<void*>(b->address), poison_byte, b->size);
    ++pool.frees;
  }
  make_room_to_settle(b, pool.is_private ? 1 : 0, more_waits);  // make_free adds b's stream in a private pool
}

SHOAL_HOT_INLINE void allocator_core::count_reusable(block_pool& pool, block* b) noexcept {
  auto& c = pool.counters;
  pool_counters::sub(c.active, 1);
  pool_counters::sub(c.active_bytes, static_cast<std::int64_t>(b->size));
  // Requested bytes count while the block is active, as PyTorch counts them.
  pool_counters::sub(c.requested_bytes, static_cast<std::int64_t>(b->requested));
  b->requested = 0;
}

SHOAL_HOT_INLINE bool allocator_core::settles_at_once(const block_pool& pool, const block* b) const noexcept {
  // Debug mode and private pools settle every block at once: poison and
  // last-stream bookkeeping want every free block in the bins.
  return config.debug || pool.is_private || !b->mapped;
}

SHOAL_HOT_INLINE void allocator_core::make_free(block_pool& pool, block* b) {
  count_reusable(pool, b);
  if (pool.is_private) add_unique(b->last_streams, b->stream);  // within prepare_free's room
  b->state = block_state::free;
  if (trace_.enabled()) trace_.note(trace_action::free_completed, b->address, b->size, b->stream);
  if (settles_at_once(pool, b)) {
    (void)pool.by_address.take(b->address);  // into the bins: out of the index
    settle(pool, b);
    return;
  }
  if (pool.quick_count == block_pool::quick_capacity) {
    b->quick = true;  // first, so the settling does not merge it
    settle_quick(pool);
  }
  park(pool, b);
}

SHOAL_HOT_INLINE void allocator_core::park(block_pool& pool, block* b) noexcept {
  b->quick = true;
  pool.quick[pool.quick_count++] = b;
  refresh_split_stat(pool, b);
}

void allocator_core::collect_pending(block_pool& pool, bool wait_on_device) {
  // Awaiting frees (no event yet) are not passed. Sealed groups complete in
  // order on the pool's stream: one query per group, and none after the
  // first that has not completed.
  backend::event_ref group{};  // the last group queried
  bool group_passed = true;
  const auto passed = [&](const block* b) {
    if (b->waits.empty()) return false;  // awaiting: sealed only from its own stream's calls
    if (b->wait_shared) {
      const backend::event_ref e = b->waits.front();
      if (e != group && group_passed) {
        group = e;
        group_passed = device.query_event(e);
      }
      return e == group && group_passed;
    }
    return std::all_of(b->waits.begin(), b->waits.end(), [&](auto e) { return device.query_event(e); });
  };
  // Kept blocks move down to [0, kept); a step that throws (a query, a
  // device wait, a free's preparation) leaves its block and the rest where
  // they are, and only the ones already made reusable leave the list.
  auto& list = pool.pending;
  std::size_t kept = 0;
  std::size_t i = 0;
  try {
    for (; i < list.size(); ++i) {
      block* b = list[i];
      const bool done = passed(b);
      // An awaiting free has no event yet for the device to wait on: kept
      // (only pinned memory's frees await, and pinned pools never wait on the device).
      if (!done && (!wait_on_device || b->waits.empty())) {
        list[kept++] = b;
        continue;
      }
      if (!done) {
        for (auto e : b->waits) device.wait(b->stream, e);
      }
      prepare_free(pool, b);
      make_reusable(pool, b);
    }
  } catch (...) {
    list.erase(list.begin() + static_cast<std::ptrdiff_t>(kept), list.begin() + static_cast<std::ptrdiff_t>(i));
    throw;
  }
  list.erase(list.begin() + static_cast<std::ptrdiff_t>(kept), list.end());
}

void allocator_core::process_pending_frees() {
  directory_.for_each_pool([&](block_pool& p) {
    std::lock_guard lock(p.lock);
    collect_pending(p, false);
  });
  check_step();
}

void allocator_core::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw invalid_argument("set_memory_fraction: " + std::to_string(fraction) + " is not in [0, 1]");
  }
  if (fraction > 0 && config.memory == allocator_memory::pinned_host) {
    throw invalid_argument("set_memory_fraction: a pinned host allocator's memory is not a share of the device");
  }
  source_.set_limit(limit_of(config, fraction, device));
}

void allocator_core::empty_cache() {
  // First, so that their vacant pools' memory goes back below; an error of
  // one destroyed stream (its failed work) is reported once everything was
  // given back.
  std::exception_ptr sweep_error;
  try {
    let_destroyed_streams_go(true);
  } catch (...) {
    sweep_error = std::current_exception();
  }
  directory_.for_each_pool([&](block_pool& p) {
    std::vector<backend::event_ref> waits;
    {
      std::lock_guard lock(p.lock);
      for (block* b : p.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
    }
    for (auto e : waits) device.synchronize_event(e);
    std::lock_guard lock(p.lock);
    collect_pending(p, false);
    source_.release_cached(p);
    if (p.vacant) (void)source_.release_unmapped_growable(p);  // each range spans the device's memory
  });
  check_step();
  if (sweep_error) std::rethrow_exception(sweep_error);
}

void allocator_core::record_stream(void* ptr, backend::stream_ref stream) {
  // A fork() child's storage dropping a block it inherited records its
  // streams first: the block is the parent's, and so may be its pool's lock.
  if (epoch_.forked_since()) [[unlikely]] return;
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  const auto note_stream = [&](block_pool& pool, block* b) {
    // A tombstone: its owner's storage records its streams before the late
    // free, which must still come to remove it. Nothing waits for them now.
    if (b->state == block_state::invalidated) return;
    if (stream != b->stream) note_used_on(pool, b, stream);
  };
  if (run_on_block(address, note_stream)) return;
  // An orphan: nothing waits for its streams (its memory may be another
  // pool's by now, inside one of its blocks: that block is not touched).
  if (orphans_.contains(address)) return;
  if (record_inside_block(address, stream)) return;
  // Again a tombstone of a pool made since, or an orphan just forgotten.
  std::lock_guard handoff(region_handoff_mutex_);
  if (run_on_block(address, note_stream) || orphans_.contains(address)) return;
  // A new segment made the orphan its tombstone between the two looks.
  if (run_on_block(address, note_stream)) return;
  throw_not_allocated(address, "record_stream");
}

bool allocator_core::record_inside_block(std::uintptr_t address, backend::stream_ref stream) {
  // A pointer inside an allocated block (a part of storage::allocate_parts,
  // a view's data): the stream holds the whole block's free back.
  block_pool* pool = directory_.directory_pool(address);
  if (pool == nullptr) return false;
  std::lock_guard lock(pool->lock);
  if (!pool->in_service) return false;
  for (const auto& s : pool->segments) {
    if (address - s->base >= s->size) continue;
    for (block* b = s->first; b != nullptr; b = b->next) {
      if (address - b->address >= b->size) continue;
      if (b->state != block_state::allocated) return false;
      if (stream != b->stream) note_used_on(*pool, b, stream);
      return true;
    }
  }
  return false;
}

std::size_t allocator_core::block_size(const void* ptr) const {
  refuse_in_fork_child(epoch_, "block_size");
  std::size_t size = 0;
  with_block(reinterpret_cast<std::uintptr_t>(ptr), "block_size", [&](block_pool&, block* b) {
    require_not_invalidated(b, "block_size");
    size = b->size;
  });
  return size;
}

void allocator_core::mark_held_outside(void* ptr) {
  refuse_in_fork_child(epoch_, "mark_held_outside");
  with_block(reinterpret_cast<std::uintptr_t>(ptr), "mark_held_outside", [&](block_pool&, block* b) {
    require_not_invalidated(b, "mark_held_outside");
    b->held_outside = true;
  });
}

void allocator_core::claim(void* ptr) {
  refuse_in_fork_child(epoch_, "claim");
  with_block(reinterpret_cast<std::uintptr_t>(ptr), "claim", [&](block_pool&, block* b) {
    // A forced clear may take the block back between its allocation and the
    // claim: a tombstone has no owner to claim it for, and its late free is
    // accepted once, as for any block taken back.
    if (b->state == block_state::invalidated) return;
    if (b->claimed) {
      throw invalid_argument("caching_allocator::claim: the block at " + hex(b->address) +
                             " has an owner already (a storage holds it); a second owner would free it twice");
    }
    b->claimed = true;
  });
}

void allocator_core::unmark_held_outside(void* ptr) {
  if (epoch_.forked_since()) [[unlikely]] return;  // a drop in a fork() child: the parent's block (record_stream)
  with_block(reinterpret_cast<std::uintptr_t>(ptr), "unmark_held_outside", [&](block_pool&, block* b) {
    if (b->state == block_state::allocated) b->held_outside = false;  // a tombstone has no mark
  });
}

}  // namespace shoal::alloc::detail
