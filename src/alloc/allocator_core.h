// The caching allocator's machinery behind caching_allocator's interface.
//
// Pools: one pair (small, large) per stream, created on first use and kept
// for the allocator's life, plus private pools. Lock order: directory, then
// one pool, then the small utility locks (block index shards, events, trace).
// Two pool locks are never held at once. Device calls may run under a pool
// lock (like cudaMalloc under PyTorch's), never under the others.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "alloc/allocator_hooks.h"
#include "alloc/block_pool.h"
#include "alloc/spin_lock.h"
#include "shoal/alloc/allocator_types.h"
#include "shoal/alloc/config.h"
#include "shoal/alloc/stats.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

[[noreturn]] void throw_not_allocated(std::uintptr_t address, const char* op);

struct stream_pools {
  block_pool small;
  block_pool large;
  block_pool& of(pool_kind kind) { return kind == pool_kind::small ? small : large; }
};

struct private_pool {
  std::vector<std::unique_ptr<block_pool>> parts;
  block_pool* part(const std::string& name);
};

class allocator_core {
 public:
  allocator_core(backend::device& device, allocator_config config);
  ~allocator_core();

  backend::device& device;
  const allocator_config config;
  allocator_hooks hooks;

  void* allocate(std::size_t bytes, backend::stream_ref stream);
  void deallocate(void* ptr, backend::stream_ref stream);
  void record_stream(void* ptr, backend::stream_ref stream);
  [[nodiscard]] std::size_t block_size(const void* ptr) const;
  void process_pending_frees();
  void empty_cache();

  // Reports settle the quick lists first, so they see every free block
  // merged as it would be without them.
  [[nodiscard]] allocator_stats stats();
  void reset_peak_stats();
  void reset_accumulated_stats();
  [[nodiscard]] snapshot take_snapshot();
  [[nodiscard]] std::vector<trace_entry> trace() const;
  void add_oom_observer(std::function<void(const oom_report&)> observer);

  private_pool_id create_private_pool(void* base, std::size_t bytes,
                                      const std::vector<std::pair<std::string, std::size_t>>& parts);
  void clear_private_pool(private_pool_id id, const std::string& part);
  void destroy_private_pool(private_pool_id id);
  /// The sub-pool this thread's allocations are directed to (nullptr: none).
  [[nodiscard]] block_pool* directed_pool() const noexcept;
  /// Directs this thread's allocations to `part`; returns the previous one.
  block_pool* direct_to(block_pool* part) noexcept;
  [[nodiscard]] block_pool& private_part(private_pool_id id, const std::string& part);

 private:
  // ---- pools
  block_pool& pool_for(backend::stream_ref stream, pool_kind kind);
  template <class Fn>
  void for_each_pool(Fn&& fn) const;

  // ---- finding a pointer's block
  /// Runs fn(pool, block) with the pool locked, for the allocated block at
  /// `address`; throws invalid_argument naming `op` when there is none.
  /// With Take, the block is taken out of the pool's index first (and goes
  /// back if fn throws).
  template <bool Take, class Fn>
  void with_block(std::uintptr_t address, const char* op, Fn&& fn) const;
  [[nodiscard]] block_pool* cached_pool(std::uintptr_t address) const noexcept;
  [[nodiscard]] block_pool* directory_pool(std::uintptr_t address) const;
  void register_segment(const segment& s);
  void unregister_segment(const segment& s);

  // ---- the allocation path (pool locked unless said otherwise)
  // Without may_grow, a miss returns nullptr instead of asking the device.
  block* try_allocate(block_pool& pool, std::size_t size, std::size_t requested, backend::stream_ref stream,
                      bool may_grow = true);
  block* allocate_slow(block_pool& pool, std::size_t size, std::size_t requested, backend::stream_ref stream);  // unlocked
  block* take_free(block_pool& pool, std::size_t size) const;  // from the bins; not removed
  [[nodiscard]] bool fits(std::size_t block_size, std::size_t size) const noexcept;
  void hand_out(block_pool& pool, block* b, std::size_t size, std::size_t requested, backend::stream_ref stream);
  // A new free block (in the bins) of at least `size`, or nullptr when the
  // device or the limit refuses.
  block* grow(block_pool& pool, std::size_t size);
  block* grow_expandable(block_pool& pool, std::size_t size);
  [[noreturn]] void out_of_memory_error(block_pool& pool, std::size_t bytes, backend::stream_ref stream);

  // ---- the free path (pool locked)
  void make_reusable(block_pool& pool, block* b);
  // Merges b with its settled free neighbours and puts the result in the
  // bins; returns it.
  block* settle(block_pool& pool, block* b);
  void settle_quick(block_pool& pool);
  // Unparks and returns a parked block of exactly `size`, or nullptr.
  [[nodiscard]] block* take_quick(block_pool& pool, std::size_t size) noexcept;
  void collect_pending(block_pool& pool, bool wait_on_device);
  void release_cached(block_pool& pool);
  void release_segment(block_pool& pool, segment* s);
  void unmap_free_chunks(block_pool& pool, segment* s);

  // ---- block structure (pool locked)
  // Cuts `b` to `size`; returns the new block after it (free, same mapping,
  // not in the bins: the caller places it).
  block* split(block_pool& pool, block* b, std::size_t size);
  block* merge_into(block_pool& pool, block* into, block* gone);
  // Brings b's share of the inactive_split stats in line with its state.
  static void refresh_split_stat(block_pool& pool, block* b) noexcept {
    const bool wanted = b->state == block_state::free && b->mapped && (b->prev != nullptr || b->next != nullptr) &&
                        !b->owner->expandable;
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
  void recycle(block_pool& pool, block* b);

  // ---- reserved-bytes accounting against the limit
  bool reserve_bytes(std::size_t bytes);
  void unreserve_bytes(std::size_t bytes) noexcept;

  // ---- events
  backend::event_ref take_event();
  void return_event(backend::event_ref event) noexcept;

  void note(trace_action action, std::uintptr_t address, std::size_t size, backend::stream_ref stream);

  const std::uint64_t serial_;
  const std::size_t limit_;
  std::atomic<std::size_t> reserved_total_{0};
  std::atomic<std::int64_t> retries_{0}, ooms_{0}, device_allocations_{0}, device_frees_{0};

  // Every segment's range and pool, for frees of pointers whose pool a
  // thread has not seen lately.
  mutable std::shared_mutex segments_mutex_;
  std::map<std::uintptr_t, std::pair<std::size_t, block_pool*>> segments_by_base_;

  mutable std::shared_mutex directory_mutex_;
  std::unordered_map<void*, std::unique_ptr<stream_pools>> stream_pools_;
  std::map<std::uint64_t, std::unique_ptr<private_pool>> private_pools_;
  // Destroyed private pools' objects: kept so a stale per-thread cache entry
  // never points at freed memory (pools live as long as the allocator).
  std::vector<std::unique_ptr<private_pool>> destroyed_pools_;
  std::uint64_t next_private_id_ = 1;

  spin_lock events_lock_;
  std::vector<backend::event_ref> spare_events_;

  mutable std::mutex trace_mutex_;
  std::vector<trace_entry> trace_;  // ring of config.trace_entries
  std::size_t trace_next_ = 0;
  bool trace_wrapped_ = false;

  std::mutex observers_mutex_;
  std::vector<std::function<void(const oom_report&)>> observers_;
};

template <class Fn>
inline void allocator_core::for_each_pool(Fn&& fn) const {
  std::vector<block_pool*> pools;
  {
    std::shared_lock lock(directory_mutex_);
    for (auto& [stream, p] : stream_pools_) {
      pools.push_back(&p->small);
      pools.push_back(&p->large);
    }
    for (auto& [id, p] : private_pools_) {
      for (auto& part : p->parts) pools.push_back(part.get());
    }
  }
  for (block_pool* p : pools) fn(*p);
}

template <bool Take, class Fn>
void allocator_core::with_block(std::uintptr_t address, const char* op, Fn&& fn) const {
  // A thread's cache may be stale (the segment was released and its range
  // reused elsewhere): a pool that does not hold the block sends us on to
  // the directory, which is always right.
  auto found_in = [&](block_pool* pool) {
    if (pool == nullptr) return false;
    std::unique_lock lock(pool->lock);
    block* b = Take ? pool->allocated.take(address) : pool->allocated.find(address);
    if (b == nullptr) return false;
    try {
      fn(*pool, b);
    } catch (...) {
      if (Take) pool->allocated.insert(b);  // nothing happened to it
      throw;
    }
    return true;
  };
  if (!found_in(cached_pool(address)) && !found_in(directory_pool(address))) throw_not_allocated(address, op);
}

}  // namespace shoal::alloc::detail
