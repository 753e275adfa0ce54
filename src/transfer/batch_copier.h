// The engine thread's work on one batch: a device storage per buffer, the
// bytes moved into it on the engine's stream (staged through pinned blocks
// when the source is pageable), the ready event, and the sources held until
// the copies reading them have run.
//
// Thread-safety: copy, release_finished and release_all are called by the
// engine's thread only; pinned_stats and the byte counters from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "transfer/batch_state.h"
#include "transfer/parallel_memcpy.h"

namespace shoal::transfer {

class transfer_engine::batch_copier {
 public:
  batch_copier(alloc::caching_allocator& device_allocator, backend::stream_ref stream, const transfer_config& config);
  ~batch_copier();
  batch_copier(const batch_copier&) = delete;
  batch_copier& operator=(const batch_copier&) = delete;

  /// Transfers `j`'s buffers. On an error, what the batch took is freed (in
  /// stream order), its sources are held until the copies already enqueued
  /// have run, and the error is thrown.
  std::shared_ptr<const transferred_batch::state> copy(job& j);
  /// Lets go of the sources whose copies have run. True while some remain.
  bool release_finished();
  /// Waits for every copy, then lets go of every source.
  void release_all() noexcept;

  [[nodiscard]] alloc::allocator_stats pinned_stats() const { return pinned_.stats(); }
  [[nodiscard]] std::uint64_t bytes_copied() const noexcept { return bytes_copied_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t bytes_staged() const noexcept { return bytes_staged_.load(std::memory_order_relaxed); }

 private:
  // Sources of copies that read them directly, held until `done` completes.
  struct held_sources {
    std::shared_ptr<backend::event> done;
    std::vector<std::shared_ptr<const void>> sources;
  };

  void stage(void* dst, const host_buffer& source);
  // Holds `sources` until the work enqueued on the stream so far has run.
  void hold_until_now(std::vector<std::shared_ptr<const void>> sources) noexcept;

  alloc::caching_allocator& device_allocator_;
  backend::device& device_;
  const backend::stream_ref stream_;
  const std::size_t chunk_bytes_;
  alloc::caching_allocator pinned_;
  std::deque<held_sources> held_;  // oldest first
  // The ready events of the last batches copied, oldest first: at most
  // queue_depth_ batches' copies are queued on the stream at once.
  std::deque<std::shared_ptr<backend::event>> queued_;
  const std::size_t queue_depth_;
  const store_kind stores_;
  parallel_memcpy memcpy_;
  std::atomic<std::uint64_t> bytes_copied_{0}, bytes_staged_{0};
};

}  // namespace shoal::transfer
