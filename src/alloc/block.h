// Blocks and segments, the allocator's bookkeeping of device memory.
//
// A segment is one range of device memory (a device segment, a growable
// reserved range, or memory handed in for a private pool). Its blocks tile
// it exactly, in address order, linked by prev/next:
//   first->address = segment.base, b->next->address = b->address + b->size,
//   sum of block sizes = segment.size.
// Two neighbouring free blocks are never both mapped or both unmapped (they
// are merged at once).
// A block is in its pool's free bins iff its state is free, it is mapped and
// it is not parked in the quick list. Free blocks in the bins are "settled";
// only settled blocks merge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shoal/alloc/stats.h"
#include "shoal/backend/types.h"

namespace shoal::alloc::detail {

struct block_pool;
struct segment;

// Cache-line aligned: blocks of different streams' pools are written by
// different threads, and must never share a line (false sharing).
struct alignas(64) block {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  ///< bytes asked for; 0 unless allocated or pending_free (active)
  segment* owner = nullptr;
  block* prev = nullptr;  ///< address-order neighbours in the segment
  block* next = nullptr;
  block* bin_prev = nullptr;  ///< links in the free bins (free blocks only);
  block* bin_next = nullptr;  ///< bin_next also links spare block objects
  std::uint32_t bin = 0;      ///< the bin it is in, while in the bins
  block_state state = block_state::free;
  /// False only for free, unbacked stretches of growable segments; those
  /// are granularity-aligned and never in the free bins.
  bool mapped = true;
  bool counted_inactive_split = false;  ///< its share of the inactive_split stats
  /// Free, but parked unmerged in its pool's quick list (see block_pool).
  bool quick = false;
  /// Allocated and shared with another process (mark_held_outside): a
  /// forced clear refuses to take it. Cleared by its free.
  bool held_outside = false;
  /// Allocated and owned by one holder that will free it (claim): a second
  /// claim is refused. Cleared by its free.
  bool claimed = false;
  backend::stream_ref stream;  ///< the stream it was handed out on
  /// Extra streams from record_stream; its free waits for them too.
  std::vector<backend::stream_ref> used_on;
  /// Events the free waits for (pending_free), or, in debug mode with
  /// cross-stream safety off, the hazard a hand-out must be checked against.
  std::vector<backend::event_ref> waits;
  /// Its one wait is a sealed group's event, shared (awaiting_frees.h).
  bool wait_shared = false;
  /// Streams that last used this free block, in private pools (shared by
  /// all streams): a hand-out to another stream first waits for them.
  std::vector<backend::stream_ref> last_streams;
};

struct segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  block_pool* pool = nullptr;
  block* first = nullptr;
  bool expandable = false;
  bool external = false;
  std::string part_name;  ///< private pools: the sub-pool's name
  /// The order the allocator took it in (pool_directory::
  /// next_segment_sequence): a segment taken later has a larger number.
  std::uint64_t sequence = 0;

  // Growable segments only: slot i covers [base + i*g, base + (i+1)*g). A
  // growth maps one physical chunk over slots [h, h + mapping_slots[h]):
  //   chunks[k] = that chunk for every slot k it covers (native 0: unmapped),
  //   mapping_slots[k] = its slot count at its first slot h, 0 elsewhere;
  // it is unmapped whole or not at all.
  std::vector<backend::physical_ref> chunks;
  std::vector<std::size_t> mapping_slots;
  std::size_t mapped_bytes = 0;
  /// Set at its first unmap: from then on its growths are cut into chunks
  /// of growable_mapping_max, else of growable_ramp_mapping_max.
  bool gave_back = false;

  [[nodiscard]] bool unused() const noexcept { return first->next == nullptr && first->state == block_state::free; }
};

/// A free block in the bins, which merges with free neighbours.
[[nodiscard]] inline bool settled_free(const block* b) noexcept {
  return b != nullptr && b->state == block_state::free && b->mapped && !b->quick;
};

}  // namespace shoal::alloc::detail
