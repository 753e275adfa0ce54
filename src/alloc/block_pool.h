// One pool of blocks: the segments of one stream and size class, or one
// sub-pool of a private pool. Everything in it is guarded by its lock.
//
// Counters are plain integers changed under the lock; the allocator sums
// them when asked, so threads on different streams never share a counter.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "alloc/block.h"
#include "alloc/block_index.h"
#include "alloc/free_bins.h"
#include "alloc/biased_lock.h"
#include "shoal/alloc/stats.h"

namespace shoal::alloc::detail {

struct pool_counters {
  stat allocations, segments, active, inactive_split;
  stat allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
  stat invalidated, invalidated_bytes;  ///< tombstones (block_state::invalidated)

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

// Cache-line aligned (size included): each stream's pools are written by
// its own threads on every allocation, and two pools must never share a line.
struct alignas(64) block_pool {
  biased_lock lock;  ///< nearly always taken by one thread: biased to it
  pool_kind kind = pool_kind::small;
  backend::stream_ref stream;  ///< stream pools: the stream every block is handed out on
  bool is_private = false;
  /// Private pools only: the memory comes from the device as the pool grows
  /// (create_growing_private_pool), not from a region handed in. It counts
  /// in the allocator's reserved total and goes back only when the pool is
  /// destroyed: no give-back touches it before.
  bool grows = false;
  /// Its blocks can be found by address (run_on_block). A private sub-pool
  /// is out of service from its making until its pool is in the directory,
  /// and again once it left: a lookup that reaches it meanwhile (a stale
  /// per-thread cache entry, a directory entry of a creation that is
  /// failing) finds nothing and takes the locked slow path. Stream pools
  /// are always in service, vacant ones too.
  bool in_service = true;
  /// Private sub-pools: how many times it was put in service. A
  /// private_pool_scope remembers it, so a scope that outlived its pool is
  /// refused even once the sub-pool serves a later private pool.
  std::uint64_t service_generation = 0;
  /// Stream pools of a stream the allocator let go, kept with their cache
  /// for the next stream that needs pools (pool_directory::vacant_pools_),
  /// parked blocks included: `stream` is the default one then, and nothing
  /// of theirs is queued on any stream, so giving their memory back
  /// synchronizes nothing and a parked block serves the next stream as is.
  bool vacant = false;
  /// Some block may have streams in its used_on (record_stream set it): a
  /// sweep for destroyed streams looks at this pool's blocks, and clears it
  /// when none has (destroyed_streams.cpp).
  bool streams_recorded = false;
  std::string part_name;  ///< private sub-pools
  /// Private sub-pools in service: their pool's id (set under `lock`).
  private_pool_id owner;

  free_bins bins;
  /// Every block of the pool but the settled free ones (in the bins, or
  /// unmapped in a growable segment), by address: allocated ones,
  /// tombstones (invalidated), pending frees and parked blocks. A block
  /// leaves it only when it settles and enters it only when it leaves the
  /// bins (a hand-out, a tombstone made), so a free and the next hand-out of
  /// a parked block touch it not at all. A look-up for a live block skips
  /// pending and parked ones (allocator_core::run_on_block).
  block_index by_address;
  std::vector<std::unique_ptr<segment>> segments;
  segment* growable = nullptr;  ///< expandable_segments: this pool's one growable segment
  std::deque<block*> pending;   ///< blocks in state pending_free
  // Pinned host pools: frees waiting for a shared event (awaiting_frees.h).
  std::vector<block*> awaiting;  ///< pending, no event recorded yet
  std::size_t awaiting_bytes = 0;
  struct sealed_group {
    backend::event_ref event;
    std::size_t holders;  ///< pending blocks whose waits list it
  };
  std::deque<sealed_group> sealed;
  block* spare = nullptr;  ///< block objects to reuse, linked by bin_next

  // The quick list: the last few blocks freed on this pool's stream, parked
  // unmerged so that the common "free, then allocate the same size again"
  // costs no merge, no split and no bin update. Any miss of the quick list
  // and the bins settles them all (merges them into the bins) before more
  // device memory is taken, so they never cause growth.
  static constexpr std::size_t quick_capacity = 16;
  std::array<block*, quick_capacity> quick{};
  std::size_t quick_count = 0;
  pool_counters counters;
  /// Frees so far (deallocate, a tombstone's late free included), and debug
  /// mode's poison fills of frees as they settle (a free that settles at once
  /// counts twice); only ever grows. A forced clear
  /// compares it before and after its device-wide wait: a free or a poison
  /// that came meanwhile may leave work of its stream queued on the memory.
  std::uint64_t frees = 0;
  /// Stream pools: the same stream's pool of the other size class (growth
  /// past the reserved peak may take its idle memory; see segment_source).
  /// Last, so that it moves none of the fields the allocation path reads.
  block_pool* sibling = nullptr;

  /// Blocks handed out and not freed, tombstones included.
  [[nodiscard]] std::size_t handed_out() const noexcept { return by_address.size() - pending.size() - quick_count; }

  block_pool() = default;
  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;
  ~block_pool() {
    while (spare != nullptr) delete std::exchange(spare, spare->bin_next);
  }

  /// A block object with every field at its default.
  [[nodiscard]] block* new_block() {
    if (spare == nullptr) return new block();
    return std::exchange(spare, spare->bin_next);
  }
  /// Keeps at least `n` block objects spare, so that the next `n` new_block
  /// calls allocate nothing.
  void reserve_blocks(std::size_t n) {
    std::size_t have = 0;
    for (const block* b = spare; b != nullptr && have < n; b = b->bin_next) ++have;
    for (; have < n; ++have) recycle(new block());
  }
  /// Takes back a block object no segment links to any more.
  void recycle(block* b) noexcept {
    // Reset field by field: the vectors keep their capacity for next time.
    b->address = 0;
    b->size = 0;
    b->requested = 0;
    b->owner = nullptr;
    b->prev = b->next = b->bin_prev = nullptr;
    b->bin = 0;
    b->state = block_state::free;
    b->mapped = true;
    b->counted_inactive_split = false;
    b->held_outside = false;
    b->claimed = false;
    b->stream = {};
    b->used_on.clear();
    b->waits.clear();
    b->wait_shared = false;
    b->last_streams.clear();
    b->bin_next = spare;
    spare = b;
  }
};

}  // namespace shoal::alloc::detail
