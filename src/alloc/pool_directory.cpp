// Finding pools: a stream's pools, a private scope's pool, the pool that
// holds a pointer.
#include "alloc/allocator_core.h"

#include <array>
#include <mutex>

#include "alloc/core_util.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

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

}  // namespace

block_pool* private_pool::part(const std::string& name) {
  for (auto& p : parts) {
    if (p->part_name == name) return p.get();
  }
  return nullptr;
}

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

}  // namespace shoal::alloc::detail
