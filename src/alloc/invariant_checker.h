// The caching allocator's invariant checker: recomputes from the blocks what
// the allocator keeps incrementally, and compares. With every pool locked
// (pool_directory::with_every_pool_locked), it checks:
//   tiling      each segment's blocks tile it: first->address = base,
//               b->next->address = b->address + b->size, b->next->prev = b,
//               b->owner = the segment, sizes sum to the segment's size;
//               unbacked (unmapped) blocks only in growable segments, free
//               and chunk-aligned, and a chunk is mapped iff a mapped block
//               holds its start; mapped_bytes = sum of mapped block sizes;
//   free bins   the bins are well formed, and a block is in them iff it is
//               settled free (free, mapped, not parked); the quick list
//               holds exactly the parked blocks, each free and mapped;
//   neighbours  no two neighbouring settled free blocks, no two
//               neighbouring unmapped ones (they would have merged);
//   states      the pool's index holds exactly its allocated blocks and
//               tombstones (invalidated, min_block mapped bytes), its
//               pending list exactly its pending_free ones; only
//               allocated blocks are marked shared with another process;
//   counters    each pool's stats equal sums recomputed from its blocks
//               (allocations, active, allocated/requested/active bytes,
//               segments, reserved bytes, inactive split, invalidated
//               blocks and bytes), with current =
//               allocated - freed <= peak; the segment source's reserved
//               total = sum of the stream pools' reserved bytes <= limit;
//   directory   the segment directory holds exactly the live pools'
//               segments, each with its size and pool; every live pool
//               is in service (its blocks can be found by address);
//   numbers     every segment has a number (segment::sequence), no two the
//               same, and each pool lists its segments in the order taken;
//   orphans     no orphaned tombstone lies where a block of a segment taken
//               from the device may start (its 512-byte grid; anywhere in
//               a growable range);
//   vacant      the pools of streams let go (kept with their cache for the
//               next new stream) are marked vacant, name no stream and hold
//               no live or pending block (parked ones they may); no other pool is marked
//               (checked after the rest, each under its own lock).
// The first broken one is thrown as invariant_violation, naming the
// invariant, the pool, the segment and the block.
#pragma once

#include <cstddef>

#include "alloc/orphaned_tombstones.h"
#include "alloc/pool_directory.h"
#include "alloc/segment_source.h"

namespace shoal::alloc::detail {

/// `granularity`: the device's mapping granularity when growable segments
/// may exist (expandable_segments), else unused.
void check_allocator_invariants(const pool_directory& directory, const segment_source& source,
                                const orphaned_tombstones& orphans, std::size_t granularity);

}  // namespace shoal::alloc::detail
