// For tests of caching_allocator::check_invariants only: breaks one of the
// allocator's invariants on purpose, so that a test can show the checker
// catches it. Never use it elsewhere: the allocator is corrupt afterwards;
// check_invariants, stats() and destroying it are all it may still be used for.
//
// Thread-safety: none; call it while no other thread uses the allocator.
#pragma once

#include <cstdint>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::alloc {

class caching_allocator;

namespace test_hook {

/// What unsafe_break_invariant breaks, around the allocated block at `ptr`
/// (allocated in a segment of its own stream pool, and not the last block of its segment).
enum class invariant_breakage : std::uint8_t {
  block_overlap,        ///< the block grows 512 bytes into the block after it
  settled_not_in_bins,  ///< the settled free block after it leaves the free bins
  free_neighbours,      ///< the settled free block after it is cut in two settled halves
  counter,              ///< its pool's allocated_bytes counter is 512 too high
  unregistered,         ///< its segment leaves the segment directory
  out_of_service,       ///< its pool goes out of service (lookups by address find nothing there)
  unnumbered,           ///< its segment loses its number (segment_snapshot::sequence)
  /// its segment, not its pool's first, takes the number of its pool's first
  numbered_as_first,
  /// `ptr` is a tombstone (a forced clear took its block): it leaves its
  /// pool's index, where its owner's late free would look for it
  tombstone_unindexed,
  /// a vacant pool (of a stream the allocator let go, kept with its cache
  /// for the next new stream) loses its vacant mark (`ptr` any live block;
  /// invalid_argument when no stream was let go)
  vacant_unmarked,
  /// a parked block of a vacant pool is handed out there, as if the pool
  /// still served a stream (`ptr` any live block; invalid_argument when no
  /// let-go stream's pool holds a parked block)
  vacant_block_handed_out,
  /// the settled free block after it still holds a stream recorded on it
  /// (record_stream's streams are let go when a block is freed)
  free_block_holds_a_recorded_stream,
};

/// Breaks `what` around the allocated block (or tombstone) at `ptr`. Throws
/// invalid_argument when `ptr` is not a live block of `allocator`, or when
/// the block after it is not what `what` needs (a settled free block).
void unsafe_break_invariant(caching_allocator& allocator, void* ptr, invariant_breakage what);

}  // namespace test_hook
}  // namespace shoal::alloc

#pragma GCC visibility pop
