// Value types of the caching allocator (caching_allocator.h) that its
// observers and pools are named by. Plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "shoal/backend/types.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::alloc {

/// What an out-of-memory observer is told before out_of_memory is thrown.
struct oom_report {
  std::size_t requested_bytes = 0;
  std::size_t device_free_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t allocated_bytes = 0;
  std::size_t largest_free_block = 0;
  /// The configured limit on reserved bytes (memory_limit or memory_fraction,
  /// the smaller); allocator_config::no_limit when none is set.
  std::size_t limit_bytes = ~std::size_t{0};
  backend::stream_ref stream;
};

/// What a segment of the allocator's is.
enum class segment_kind : std::uint8_t {
  plain,      ///< one allocation from the device (a growing private pool's included)
  growable,   ///< a growable range (expandable_segments)
  handed_in,  ///< memory handed to create_private_pool, which the allocator never frees
};

/// The segment that holds an allocated block
/// (caching_allocator::segment_of_allocated_block).
struct block_segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;  ///< the whole range; a growable one's reserved range, mapped or not
  segment_kind kind = segment_kind::plain;
};

/// A private pool: memory handed in from outside, split into named
/// sub-pools. Identified by the id create_private_pool returns.
struct private_pool_id {
  std::uint64_t value = 0;
  friend bool operator==(private_pool_id, private_pool_id) = default;
};

/// A growing private pool's layout at one moment
/// (caching_allocator::checkpoint_private_pool): each segment's blocks in
/// address order, tiling it, and which of them were allocated, for whom.
struct pool_checkpoint {
  struct block_state {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    bool allocated = false;      ///< handed out and not freed (a free waiting for a stream is freed)
    std::size_t requested = 0;   ///< allocated: the bytes asked for
    backend::stream_ref stream;  ///< allocated: the stream it was handed out on
  };
  struct segment_state {
    std::uintptr_t base = 0;
    std::size_t size = 0;
    std::vector<block_state> blocks;
  };
  private_pool_id pool;
  std::vector<segment_state> segments;  ///< by base address
};

/// What restoring a checkpoint did (caching_allocator::restore_private_pool).
struct pool_restore_result {
  /// Blocks that were allocated and are not any more: their owners must not
  /// free them (a free would free whatever holds the address now).
  std::vector<std::uintptr_t> freed;
  struct allocated_block {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    backend::stream_ref stream;  ///< the stream it was handed out on, as the checkpoint has it
    friend bool operator==(const allocated_block&, const allocated_block&) = default;
  };
  /// The checkpoint's allocated blocks, allocated again: each is its new
  /// owner's to free. A block in both lists changed owner.
  std::vector<allocated_block> allocated;
};

/// What clearing or destroying a private pool does with blocks still
/// allocated in it.
enum class live_blocks : std::uint8_t {
  /// invalid_argument naming them; nothing changes (the default).
  refuse,
  /// Forces it: the whole device is synchronized (streams the allocator was
  /// never told about included), then the blocks are taken back. Each
  /// leaves a tombstone (block_state::invalidated, 512 bytes at its
  /// address) so that no newer block starts where it did: its owner's late
  /// free finds the tombstone and removes it, and never frees a newer
  /// block. Blocks shared with another process (mark_held_outside) are
  /// never taken: invalid_argument naming them, and nothing changes. On
  /// CUDA, not while another thread captures a graph in global mode (see
  /// device::synchronize_device). A device that does not implement
  /// synchronize_device refuses it: backend_error, and nothing changes.
  invalidate,
};

/// One block a forced clear took from its owner.
struct invalidated_block {
  std::uintptr_t address = 0;
  std::size_t size = 0;  ///< the block's size when it was taken
};

/// The blocks a forced clear took from their owners, in address order.
struct invalidated_blocks_report {
  std::vector<invalidated_block> blocks;
  std::size_t bytes = 0;  ///< sum of their sizes
};

}  // namespace shoal::alloc

#pragma GCC visibility pop
