// The engine thread's work on one group of batches taken together: a device
// storage per buffer, each a part of one device block for the whole group
// (storage::allocate_parts: one allocator call), the bytes moved into them on
// the engine's stream (small pageable buffers packed into shared staging
// blocks, in the parts' layout, so that a run of them is one copy; larger
// ones staged chunk by chunk; pinned ones copied directly), one ready event
// for the group, and the sources held until the copies reading them have run.
// When the group's block cannot be had, each batch takes a block of its own
// (and fails alone when it cannot have that either).
//
// Thread-safety: copy, release_finished and release_all are called by the
// engine's thread only; pinned_stats and the byte counters from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/storage/storage.h"
#include "transfer/batch_state.h"
#include "transfer/parallel_memcpy.h"
#include "transfer/staging_frees.h"

namespace shoal::transfer {

class staging_pack;

/// The pinned memory one staging chunk of `config` reserves: the staging
/// allocator's block, rounded up to its segment (2 MiB steps).
[[nodiscard]] std::size_t pinned_bytes_of_chunk(const transfer_config& config);

class transfer_engine::batch_copier {
 public:
  batch_copier(alloc::caching_allocator& device_allocator, backend::stream_ref stream, const transfer_config& config);
  ~batch_copier();
  batch_copier(const batch_copier&) = delete;
  batch_copier& operator=(const batch_copier&) = delete;

  /// Transfers the batches of `jobs` (at most max_batches_in_flight) as one
  /// group sharing a ready event: one outcome per job, in their order. A
  /// batch that fails fails with its own error (a failed packed run fails
  /// every batch with a buffer in it): what it allocated is freed in stream
  /// order (a part, with its group's block), its sources are held until the
  /// group's copies have run.
  std::vector<outcome> copy(std::span<job> jobs);
  /// Lets go of the sources whose copies have run, and frees again the
  /// staging blocks whose frees the host refused. True while some of either
  /// remain (the engine's thread then looks again soon).
  /// An event that cannot be queried (a failed stream) counts as done, as
  /// in release_all: this runs in the engine thread's noexcept loop.
  bool release_finished() noexcept;
  /// Waits for every copy, then lets go of every source.
  void release_all() noexcept;

  [[nodiscard]] alloc::allocator_stats pinned_stats() const { return pinned_.stats(); }
  [[nodiscard]] std::uint64_t bytes_copied() const noexcept { return bytes_copied_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t bytes_staged() const noexcept { return bytes_staged_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t copies() const noexcept { return copies_.load(std::memory_order_relaxed); }

 private:
  // Sources of copies that read them directly, held until `done` completes.
  struct held_sources {
    std::shared_ptr<backend::event> done;
    std::vector<std::shared_ptr<const void>> sources;
  };
  // A group whose copies are queued on the stream.
  struct queued_group {
    std::shared_ptr<backend::event> done;
    std::size_t batches, bytes;
  };

  // Storages for every buffer of `jobs`, parts of one block; empty when the
  // group is one batch or the block cannot be had.
  std::vector<storage::storage> group_targets(std::span<const job> jobs);
  // Storages for the buffers of `j` alone.
  std::vector<storage::storage> batch_targets(const job& j);
  // Batch `index` of the group into `targets` (one per buffer, parts of the
  // device block `block`; empty: the batch allocates its own into it): its
  // bytes enqueued or joined to the pack's run, `targets` moved into the
  // batch returned. Sources read directly go to `read_directly` (room
  // reserved: nothing throws once a copy is enqueued), kept until the
  // group's copies have run; `reads_callers_memory` is set once a copy is
  // enqueued straight from a pinned buffer with no keep_alive.
  std::shared_ptr<const transferred_batch::state> transfer(job& j, std::size_t index,
                                                           std::vector<storage::storage>& targets, const void* block,
                                                           const std::shared_ptr<backend::event>& ready,
                                                           staging_pack& pack,
                                                           std::vector<std::shared_ptr<const void>>& read_directly,
                                                           bool& reads_callers_memory);
  void stage_in_chunks(void* dst, const host_buffer& source);
  // Waits until `batches` more batches of `bytes` in all fit in the
  // stream's queue.
  void make_room(std::size_t batches, std::size_t bytes);
  // Waits until the work enqueued on the stream so far has run (`done`,
  // recorded last, when there is one): a failed batch that read its
  // caller's memory directly is reported only after that.
  void wait_for_copies(const std::shared_ptr<backend::event>& done) noexcept;
  // Holds `sources` until the work enqueued on the stream so far has run.
  void hold_until_now(std::vector<std::shared_ptr<const void>> sources) noexcept;

  alloc::caching_allocator& device_allocator_;
  backend::device& device_;
  const backend::stream_ref stream_;
  const std::size_t chunk_bytes_;
  alloc::caching_allocator pinned_;
  staging_frees staging_frees_;  // after pinned_: it frees into it
  // Lists, not deques: a group's entries are made before its first copy is
  // enqueued and spliced in after its last (splicing cannot throw), so no
  // source is let go of for want of memory while a copy reads it.
  std::list<held_sources> held_;  // oldest first
  // The groups copied last, oldest first: queued_batches_ = the sum of their
  // batches <= queue_depth_, the batches whose copies may be queued at once,
  // and queued_bytes_ = the sum of their bytes <= queue_bytes_ (or one group
  // alone, larger than that).
  std::list<queued_group> queued_;
  std::size_t queued_batches_ = 0, queued_bytes_ = 0;
  const std::size_t queue_depth_, queue_bytes_;
  const store_kind stores_;
  parallel_memcpy memcpy_;
  std::atomic<std::uint64_t> bytes_copied_{0}, bytes_staged_{0}, copies_{0};
};

}  // namespace shoal::transfer
