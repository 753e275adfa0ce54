// A staging copy split across a few threads: one thread's memcpy moves
// 8-12 GB/s, a fifth of what a PCIe Gen5 link takes from pinned memory, so
// staging pageable bytes on one thread would cap the engine far below the
// link. Slices of min_slice and more are copied with streaming stores
// (streaming_copy.h): the destination is read next by the copy engine only.
//
// Thread-safety: copy is called by one thread at a time (the engine's).
// Invariant: while a copy runs, every slice is taken by exactly one thread
// (the caller or a helper), and copy returns only after all are done.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace shoal::transfer {

class parallel_memcpy {
 public:
  /// `helpers` threads besides the caller (0: the caller copies alone).
  explicit parallel_memcpy(std::size_t helpers);
  ~parallel_memcpy();
  parallel_memcpy(const parallel_memcpy&) = delete;
  parallel_memcpy& operator=(const parallel_memcpy&) = delete;

  /// Copies `bytes` from `src` to `dst` (not overlapping); returns when done,
  /// with every store visible to the copy engine.
  void copy(void* dst, const void* src, std::size_t bytes);

 private:
  static constexpr std::size_t min_slice = std::size_t{256} << 10;

  void help() noexcept;
  // Copies the slices left of the current job until none remain.
  void take_slices(std::unique_lock<std::mutex>& lock);

  std::mutex mutex_;
  std::condition_variable work_, done_;
  // The current job, guarded by mutex_.
  std::byte* dst_ = nullptr;
  const std::byte* src_ = nullptr;
  std::size_t bytes_ = 0, slice_ = 0, slices_ = 0, next_slice_ = 0, finished_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> helpers_;
};

}  // namespace shoal::transfer
