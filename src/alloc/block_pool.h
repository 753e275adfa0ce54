// One pool of blocks: the segments of one stream and size class, or one
// sub-pool of a private pool. Everything in it is guarded by its lock.
//
// Counters are plain integers changed under the lock; the allocator sums
// them when asked, so threads on different streams never share a counter.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "alloc/block.h"
#include "alloc/free_bins.h"
#include "alloc/spin_lock.h"
#include "shoal/alloc/stats.h"

namespace shoal::alloc::detail {

struct pool_counters {
  stat allocations, segments, active, inactive_split;
  stat allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;

  static void add(stat& s, std::int64_t n) noexcept {
    s.current += n;
    s.allocated += n;
    if (s.current > s.peak) s.peak = s.current;
  }
  static void sub(stat& s, std::int64_t n) noexcept {
    s.current -= n;
    s.freed += n;
  }
};

struct block_pool {
  spin_lock lock;
  pool_kind kind = pool_kind::small;
  backend::stream_ref stream;  ///< stream pools: the stream every block is handed out on
  bool is_private = false;
  std::string part_name;  ///< private sub-pools

  free_bins bins;
  std::vector<std::unique_ptr<segment>> segments;
  segment* growable = nullptr;  ///< expandable_segments: this pool's one growable segment
  std::deque<block*> pending;   ///< blocks in state pending_free
  std::vector<std::unique_ptr<block>> spare;  ///< block objects to reuse
  pool_counters counters;

  [[nodiscard]] std::unique_ptr<block> new_block() {
    if (spare.empty()) return std::make_unique<block>();
    auto b = std::move(spare.back());
    spare.pop_back();
    return b;
  }
};

}  // namespace shoal::alloc::detail
