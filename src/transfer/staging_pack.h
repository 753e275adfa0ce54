// Small pageable buffers of one group staged together: each is copied into
// the current pinned block at the next 256-byte boundary and its device copy
// is enqueued from there at once; the block is given back (in stream order,
// after those copies: the pinned allocator then holds it until they have
// run) when a buffer does not fit any more, before a larger buffer is staged
// outside the pack, or when the pack is destroyed.
// So a group of small batches takes one staging block and gives back one,
// instead of one per buffer.
//
// Invariant: used_ <= capacity_, and every byte below used_ is reserved for a
// copy (enqueued, or one that failed): none is handed to another buffer.
//
// Thread-safety: one thread (the engine's) uses a pack; it lives for one group.
#pragma once

#include <cstddef>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/transfer/transfer_engine.h"
#include "transfer/parallel_memcpy.h"

namespace shoal::transfer {

class staging_pack {
 public:
  static constexpr std::size_t alignment = 256;
  /// Bytes a buffer of `bytes` takes in a block.
  static constexpr std::size_t footprint(std::size_t bytes) noexcept {
    return (bytes + alignment - 1) / alignment * alignment;
  }

  /// Packs into blocks of at most `block_bytes`; `total_bytes` is the
  /// footprint of every buffer the group will stage here (it sizes the
  /// blocks: the last one is no larger than what is left).
  staging_pack(alloc::caching_allocator& pinned, backend::stream_ref stream, std::size_t block_bytes,
               std::size_t total_bytes, parallel_memcpy& memcpy, store_kind stores);
  /// Gives the current block back.
  ~staging_pack();
  staging_pack(const staging_pack&) = delete;
  staging_pack& operator=(const staging_pack&) = delete;

  /// Whether a buffer of `bytes` goes through a pack (it fits in one block).
  [[nodiscard]] static bool takes(std::size_t bytes, std::size_t block_bytes) noexcept {
    return footprint(bytes) <= block_bytes;
  }
  /// Stages `source` (takes() holds) and enqueues its copy into `dst`.
  void stage(void* dst, const host_buffer& source);
  /// Gives the current block back (in stream order); the next buffer starts
  /// a new one. Before a buffer is staged outside the pack: the two would
  /// otherwise hold pinned memory at once, past the bound when it is one chunk.
  void give_back() noexcept;

 private:
  alloc::caching_allocator& pinned_;
  backend::device& device_;
  const backend::stream_ref stream_;
  const std::size_t block_bytes_;
  std::size_t still_to_stage_;  // footprint of the group's buffers not yet staged
  parallel_memcpy& memcpy_;
  const store_kind stores_;
  std::byte* block_ = nullptr;
  std::size_t capacity_ = 0, used_ = 0;
};

}  // namespace shoal::transfer
