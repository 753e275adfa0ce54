// Small pageable buffers of one group staged together: each is copied into
// the current pinned block at the next 256-byte boundary, and its device
// copy joins the run of copies before it when its bytes continue that run
// on both sides (the same device block; the same distance from the run's
// start in the staging block and on the device, with no more than alignment
// padding since the run's last buffer), else it starts a run of its own. A run is enqueued as ONE copy
// (padding bytes included: they belong to no buffer on either side) when the
// next buffer does not continue it, and before the block is given back —
// when a buffer does not fit any more, before a larger buffer is staged
// outside the pack, or when the pack is done — in stream order: the pinned
// allocator then holds the block until those copies have run.
// So a group of small batches whose device buffers are parts of one block
// (storage::allocate_parts, the same alignment) takes one staging block and
// one copy, instead of one of each per buffer.
//
// The run's buffers are staged (copied into the block, across the memcpy's
// threads at once) when the run's copy is enqueued, not one by one.
//
// Invariants: used_ <= capacity_, and every byte below used_ is reserved for
// a copy (enqueued, in the run, or one that failed): none is handed to another
// buffer. The run lies within [block_, block_ + used_); unstaged_ holds
// exactly the run's buffers, each staged before the run's copy is enqueued.
// Errors: a run whose copy fails fails every batch with a buffer in it
// (error(batch)), not only the batch staged last.
//
// Thread-safety: one thread (the engine's) uses a pack; it lives for one group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/storage/storage.h"
#include "shoal/transfer/transfer_engine.h"
#include "transfer/parallel_memcpy.h"
#include "transfer/staging_frees.h"

namespace shoal::transfer {

class staging_pack {
 public:
  /// Where buffers start in a staging block: the device parts' alignment
  /// (storage::part_alignment), so a run has the same layout on both sides.
  static constexpr std::size_t alignment = storage::storage::part_alignment;
  /// Bytes a buffer of `bytes` takes in a block.
  static constexpr std::size_t footprint(std::size_t bytes) noexcept {
    return (bytes + alignment - 1) / alignment * alignment;
  }

  /// Packs into blocks of at most `block_bytes`; `total_bytes` is the
  /// footprint of every buffer the group will stage here (it sizes the
  /// blocks: the last one is no larger than what is left); `batches`: how
  /// many batches the group holds (their indices, 0 to batches - 1, name
  /// the owners of buffers in stage and error). Blocks go back to `pinned`
  /// through `frees` (on `stream`).
  staging_pack(alloc::caching_allocator& pinned, staging_frees& frees, backend::stream_ref stream,
               std::size_t block_bytes, std::size_t total_bytes, std::size_t batches, parallel_memcpy& memcpy,
               store_kind stores);
  /// Gives the current block back (after the run's copy).
  ~staging_pack();
  staging_pack(const staging_pack&) = delete;
  staging_pack& operator=(const staging_pack&) = delete;

  /// Whether a buffer of `bytes` goes through a pack (it fits in one block).
  [[nodiscard]] static bool takes(std::size_t bytes, std::size_t block_bytes) noexcept {
    return footprint(bytes) <= block_bytes;
  }
  /// Stages `source` (takes() holds), a buffer of batch `batch`, and puts
  /// its copy into `dst` in the run (enqueued by give_back at the latest).
  /// Takes `source.keep_alive`: the bytes are read when the run's copy is
  /// enqueued, and the source is let go of then.
  /// `dst` lies in the device block `dst_block` (one allocation, whose
  /// buffers start part_alignment-aligned from it): runs never leave a block.
  void stage(void* dst, const void* dst_block, host_buffer& source, std::size_t batch);
  /// Enqueues the run's copy and gives the current block back (in stream
  /// order); the next buffer starts a new one. Before a buffer is staged or
  /// copied outside the pack, and once the group is done: the two would
  /// otherwise hold pinned memory at once, past the bound when it is one chunk.
  void give_back() noexcept;
  /// The error of the copy of a run that held a buffer of `batch`, or null.
  [[nodiscard]] std::exception_ptr error(std::size_t batch) const { return errors_.at(batch); }
  /// Device copies enqueued so far.
  [[nodiscard]] std::uint64_t copies() const noexcept { return copies_; }

 private:
  alloc::caching_allocator& pinned_;
  staging_frees& frees_;
  backend::device& device_;
  const backend::stream_ref stream_;
  const std::size_t block_bytes_;
  std::size_t still_to_stage_;  // footprint of the group's buffers not yet staged
  parallel_memcpy& memcpy_;
  const store_kind stores_;
  std::byte* block_ = nullptr;
  std::size_t capacity_ = 0, used_ = 0;
  // The copies joined so far: `bytes` from `from` (in block_) to `to` (in
  // `to_block`), for buffers of batches first_batch to last_batch. Empty
  // when bytes == 0.
  struct run {
    const std::byte* from = nullptr;
    std::byte* to = nullptr;
    const void* to_block = nullptr;
    std::size_t bytes = 0;
    std::size_t first_batch = 0, last_batch = 0;
  } run_;
  std::vector<copy_job> unstaged_;  // the run's buffers, not yet copied into the block
  std::vector<std::shared_ptr<const void>> sources_kept_;  // their keep_alive, held until they are
  std::vector<std::exception_ptr> errors_;  // one per batch of the group
  std::uint64_t copies_ = 0;

  // Whether a buffer staged at `from`, bound for `to`, continues run_.
  [[nodiscard]] bool continues_run(const std::byte* from, const std::byte* to, const void* to_block) const noexcept;
  // Enqueues run_'s copy and empties it; a failure goes to errors_.
  void flush() noexcept;
};

}  // namespace shoal::transfer
