// A staging copy split across a few threads: one thread's memcpy moves
// 8-12 GB/s, a fifth of what a PCIe Gen5 link takes from pinned memory, so
// staging pageable bytes on one thread would cap the engine far below the
// link. Slices are copied either with ordinary stores (the destination stays
// in the cache, where the copy engine's reads find it when the staging ring
// is small enough to stay there) or with streaming stores (streaming_copy.h:
// no read of each destination line first).
//
// Helpers stay awake for spin_window after a copy, watching for the next:
// staging a stream of batches hands them one copy after another, and waking
// a sleeping thread costs more than copying a 1 MiB slice.
//
// Thread-safety: copy is called by one thread at a time (the engine's).
// Invariant: while a copy runs, every slice is taken by exactly one thread
// (the caller or a helper), and copy returns only after all are done; the
// job's fields change only between copies, when no helper holds a slice.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace shoal::transfer {

enum class store_kind : std::uint8_t {
  cached,     ///< ordinary stores: the destination stays in the cache
  streaming,  ///< non-temporal stores: the destination goes to memory
};

class parallel_memcpy {
 public:
  /// `helpers` threads besides the caller (0: the caller copies alone).
  explicit parallel_memcpy(std::size_t helpers);
  ~parallel_memcpy();
  parallel_memcpy(const parallel_memcpy&) = delete;
  parallel_memcpy& operator=(const parallel_memcpy&) = delete;

  /// Copies `bytes` from `src` to `dst` (not overlapping); returns when done,
  /// with every store visible to the copy engine.
  void copy(void* dst, const void* src, std::size_t bytes, store_kind stores);

  static constexpr std::size_t min_slice = std::size_t{256} << 10;
  static constexpr std::chrono::microseconds spin_window{200};

 private:
  void help() noexcept;
  // Copies the slices left of the current job until none remain.
  void take_slices() noexcept;
  static void copy_slice(std::byte* to, const std::byte* from, std::size_t n, store_kind stores) noexcept;

  std::mutex mutex_;  // guards the job's fields below and sleepers_
  std::condition_variable work_;
  std::byte* dst_ = nullptr;
  const std::byte* src_ = nullptr;
  std::size_t bytes_ = 0, slice_ = 0, slices_ = 0, next_slice_ = 0;
  store_kind stores_ = store_kind::streaming;
  std::size_t sleepers_ = 0;
  // Read by spinning helpers without the lock; changed under it.
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<std::size_t> finished_{0};
  std::vector<std::thread> helpers_;
};

}  // namespace shoal::transfer
