// The segment source: the device-memory side of the allocator. It takes a
// segment (or, for growable ranges, chunks) from the device when a pool
// must grow, gives wholly free memory back, and keeps the memory reserved
// from the device under the limit.
//
// Invariant:
//   reserved_total() = sum of reserved_bytes.current over the stream pools
//                      and the growing private pools (other private
//                      pools' memory is the caller's: not counted)
//                      + detached bytes (a destroyed growing pool's
//                      segments between leaving it and the device)
//                    <= ceiling() (the limit, or the highest limit set
//                       before it when set_limit has lowered it: memory
//                       reserved under an earlier limit stays reserved).
// Thread-safety: grow, release_cached and release_at_teardown run with the
// pool's lock held and touch only that pool (and the leaf locks: segment
// directory, trace, hooks), except that growth past the reserved peak may
// take its sibling's lock with try_lock and give that pool's idle memory
// back; the reserved total is one atomic shared by all pools, bumped by
// compare-and-swap against the limit, and its peak another, raised after
// each growth; the device counters are relaxed atomics.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "alloc/allocator_hooks.h"
#include "alloc/block_pool.h"
#include "alloc/chunk_mapper.h"
#include "alloc/event_pool.h"
#include "alloc/orphaned_tombstones.h"
#include "alloc/pool_directory.h"
#include "alloc/trace_ring.h"
#include "shoal/alloc/config.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

/// The reserved-bytes limit of `config` with `memory_fraction` of the
/// device (0: none) in place of the configured fraction.
[[nodiscard]] std::size_t limit_of(const allocator_config& config, double memory_fraction, backend::device& device);

class segment_source {
 public:
  segment_source(backend::device& device, const allocator_config& config, pool_directory& directory,
                 trace_ring& trace, const allocator_hooks& hooks, event_pool& events, orphaned_tombstones& orphans,
                 std::mutex& region_handoff);
  segment_source(const segment_source&) = delete;
  segment_source& operator=(const segment_source&) = delete;

  /// A new free block (in the bins) of at least `size`, or nullptr when the
  /// pool may not grow or the device or the limit refuses. The standard
  /// segment is asked for first; with `right_sized_allowed`, a refused one is
  /// followed by a segment of the block's own size (the allocator allows it
  /// only once the cheaper ways, reusing pending frees and giving cached
  /// memory back, have failed).
  block* grow(block_pool& pool, std::size_t size, bool right_sized_allowed);
  /// Gives the pool's wholly free segments, and the whole free chunks of its
  /// growable segment, back to the device (after its stream has passed them).
  void release_cached(block_pool& pool);
  /// Gives the pool's growable segment's address range back when nothing of
  /// it is mapped (release_cached first): for a vacant pool (each growable
  /// range spans the device's memory in address space). Returns whether the
  /// pool holds no growable segment now; throws the device's error and
  /// changes nothing when the range does not go back.
  bool release_unmapped_growable(block_pool& pool);
  /// Gives back the plain segments [base, base + size) of growing private
  /// pool `pool`, which left the directory with them (destroy_private_pool):
  /// observers told (the events name `pool`), memory freed, the reserved
  /// total lowered. Goes on past a failing free (that segment's memory is
  /// lost to the allocator) and then throws the first error.
  void free_detached_segments(private_pool_id pool, const std::vector<std::pair<std::uintptr_t, std::size_t>>& segments);
  /// Counts `bytes` of a growing pool's segments as detached: called while
  /// the pool leaves the directory (every lock of it held), before
  /// free_detached_segments gives them back.
  void note_detached(std::size_t bytes);
  /// reserved_total() less the detached bytes: what the pools hold. Read
  /// with every pool lock held, it equals their sum (the invariant checker).
  [[nodiscard]] std::size_t reserved_in_pools() const;
  /// Allocator teardown: waits for the work queued on the pool's memory
  /// (pending frees' events, the pool's stream), gives every event back to
  /// `events`, deletes every block and returns the pool's device memory,
  /// ignoring device errors.
  void release_at_teardown(block_pool& pool, event_pool& events) noexcept;

  [[nodiscard]] std::size_t limit() const noexcept { return limit_.load(std::memory_order_relaxed); }
  /// A new limit from now on (set_memory_fraction). Memory reserved past a
  /// lowered limit stays until it is released; no growth happens until the
  /// reserved total is below the new limit.
  void set_limit(std::size_t limit) noexcept;
  /// What the reserved total never exceeds (checked by the invariant checker).
  [[nodiscard]] std::size_t ceiling() const noexcept;
  [[nodiscard]] std::size_t reserved_total() const noexcept { return reserved_total_.load(std::memory_order_relaxed); }
  /// The high-water mark of reserved_total() since creation or the last
  /// reset_reserved_peak(): exact, since it moves only where the total does
  /// (growth), off the allocation fast path.
  [[nodiscard]] std::size_t reserved_peak() const noexcept { return reserved_peak_.load(std::memory_order_relaxed); }
  void reset_reserved_peak() noexcept;
  /// Segments taken from the device, and growable segments' chunks created.
  [[nodiscard]] std::int64_t device_allocations() const noexcept {
    return device_allocations_.load() + mapper_.counts().creates;
  }
  /// Segments given back, and growable segments' chunks released.
  [[nodiscard]] std::int64_t device_frees() const noexcept { return device_frees_.load() + mapper_.counts().releases; }
  [[nodiscard]] vmm_call_counts vmm_calls() const noexcept { return mapper_.counts(); }
  /// Bytes of growable segments' physical chunks held (checked against
  /// their mapped bytes: no chunk is held unmapped between calls).
  [[nodiscard]] std::size_t physical_chunk_bytes() const noexcept { return mapper_.held_bytes(); }
  void reset_device_counters() noexcept;

 private:
  // Segments taken in one growth whose free blocks around orphaned
  // tombstones were all too small for the request.
  static constexpr std::size_t max_segments_over_tombstones = 4;
  // Growable ranges reserved in one growth that each lay over one.
  static constexpr std::size_t max_ranges_over_tombstones = 4;
  /// Where a growable segment maps chunks for a block of `size`: the
  /// unbacked block `u`, the bytes to map there (u nullptr: nowhere), at
  /// its start or at its end.
  struct stretch {
    block* u = nullptr;
    std::size_t need = 0;
    bool at_end = false;
  };
  /// grow with a plain segment: its largest free block (in the bins),
  /// which may be smaller than `size` when the segment covers orphaned
  /// tombstones, or nullptr. The segments in `held` are not given back.
  block* grow_plain(block_pool& pool, std::size_t size, bool right_sized_allowed,
                    std::span<const segment* const> held);
  /// Makes the orphaned tombstones inside the new segment `s` (its one
  /// free block not in the bins yet) tombstones there again, at most
  /// room.size() of them, so that no block of it starts where a taken
  /// block did; puts the free blocks around them in the bins and returns
  /// the largest. Room for their blocks and index entries is reserved.
  block* keep_orphans_as_tombstones(block_pool& pool, segment& s, std::span<std::uintptr_t> room) noexcept;
  block* grow_expandable(block_pool& pool, std::size_t size);
  /// A range of `span` bytes clear of orphaned tombstones, or nullptr when
  /// the device refuses or every range it gave lay over one.
  void* reserve_clear_of_orphans(std::size_t span);
  /// Reserves the pool's one growable range; false when the device refuses.
  bool reserve_growable(block_pool& pool, std::size_t size);
  [[nodiscard]] stretch stretch_for(const segment& s, std::size_t size) const;
  /// A segment of `bytes` from the device, counted against the limit, or
  /// nullptr when the limit or the device refuses.
  void* take_segment(std::size_t bytes);
  /// Gives a plain (not growable) segment back, pinned or device memory.
  void free_plain_segment(std::uintptr_t base);
  /// Whether every block of plain segment `s` is settled free but for one
  /// or more tombstones (taken from orphans: released, they are orphans again).
  [[nodiscard]] static bool free_but_for_tombstones(const segment& s) noexcept;
  /// Gives plain segment `s` back: it is unused or free_but_for_tombstones.
  void release_segment(block_pool& pool, segment* s);
  /// Gives back the pool's wholly free segments (free but for tombstones
  /// included; not those in `held`) and whole free mappings (not in `keep`)
  /// until at least `budget` bytes went back or none is left, after its
  /// stream has passed them; returns the bytes given back.
  /// Unmapped chunks go to `spare` where given (for a growth to map
  /// again), else back to the device.
  std::size_t give_back(block_pool& pool, std::size_t budget, const block* keep, spare_chunks* spare,
                        std::span<const segment* const> held = {});
  /// give_back on the pool's sibling (its stream's other size class) when
  /// that one's lock is free at once.
  void give_back_from_sibling(block_pool& pool, std::size_t budget, spare_chunks* spare);
  /// Unmaps whole chunks inside free blocks other than `keep`, in address
  /// order, until at least `budget` bytes are unmapped or none is left;
  /// returns the bytes unmapped. Their chunks go to `spare` where given.
  std::size_t unmap_free_chunks(block_pool& pool, segment* s, std::size_t budget, const block* keep,
                                spare_chunks* spare);
  bool reserve_bytes(std::size_t bytes);
  /// Raises reserved_peak() to the total after a growth.
  void note_reserved_peak() noexcept;
  /// How far taking `bytes` more would raise reserved_peak() (0: not at all).
  [[nodiscard]] std::size_t over_peak(std::size_t bytes) const noexcept;
  void unreserve_bytes(std::size_t bytes) noexcept;
  /// A segment event into the trace (when on) and to the segment observers.
  void note_segment(trace_action action, std::uintptr_t address, std::size_t size, backend::stream_ref stream,
                    private_pool_id pool) const noexcept;
  /// The same, of a segment of `pool`.
  void note_segment(trace_action action, std::uintptr_t address, std::size_t size, const block_pool& pool) const noexcept;

  backend::device& device_;
  const allocator_config& config_;
  pool_directory& directory_;
  trace_ring& trace_;
  const allocator_hooks& hooks_;
  event_pool& events_;  // where a released segment's hazard events go (debug mode)
  // Tombstones of destroyed private pools: a new segment over one keeps it.
  orphaned_tombstones& orphans_;
  // allocator_core's region hand-off lock: a segment's tombstones become
  // orphans again only under it, so a late free between its looks (which
  // holds it) never sees one go back.
  std::mutex& region_handoff_;
  std::atomic<std::size_t> limit_;
  // The highest limit set_limit has replaced (0 while none was lowered).
  std::atomic<std::size_t> highest_earlier_limit_{0};
  std::atomic<std::size_t> reserved_total_{0};
  std::atomic<std::size_t> reserved_peak_{0};
  // Lowered with reserved_total_ under one lock, so a reader sees both or neither.
  mutable std::mutex detached_mutex_;
  std::size_t detached_bytes_ = 0;  // guarded by detached_mutex_
  // Plain segments; growable segments' chunks are counted by mapper_.
  std::atomic<std::int64_t> device_allocations_{0}, device_frees_{0};
  chunk_mapper mapper_;
};

}  // namespace shoal::alloc::detail
