// A staging copy split across a few threads: one thread's memcpy moves
// 8-12 GB/s, a fifth of what a PCIe Gen5 link takes from pinned memory, so
// staging pageable bytes on one thread would cap the engine far below the
// link. A list of copies is split the same way, by bytes, as if the copies
// were one (a group of small batches: each buffer too small to split, all of
// them together worth several threads). Slices are copied either with ordinary stores (the destination stays
// in the cache, where the copy engine's reads find it when the staging ring
// is small enough to stay there) or with streaming stores (streaming_copy.h:
// no read of each destination line first).
//
// Helpers stay awake for spin_window after a copy, watching for the next:
// staging a stream of batches hands them one copy after another, and waking
// a sleeping thread costs more than copying a 1 MiB slice. The first
// narrow_threads - 1 helpers watch after every copy; the others ("wide"
// helpers, for copies on more than narrow_threads threads) only after a copy
// they took part in, and otherwise sleep until a wide copy wakes them: idle
// threads watching beside a stream of narrow copies took the CPUs the
// copies' own threads needed (on the H200 host, 64 KiB batches staged at
// half the speed with 15 helpers watching as with 7).
//
// Thread-safety: copy is called by one thread at a time (the engine's).
// Invariant: while a copy runs, every slice is taken by exactly one thread
// (the caller or one of the first slices - 1 helpers), and copy returns only
// after all are done; the copy's fields change only between copies, when no
// helper holds a slice. Slice k covers bytes [k * slice, (k + 1) * slice) of
// the copies laid end to end.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace shoal::transfer {

enum class store_kind : std::uint8_t {
  cached,     ///< ordinary stores: the destination stays in the cache
  streaming,  ///< non-temporal stores: the destination goes to memory
  /// Streaming when the copy runs on at most parallel_memcpy::narrow_threads
  /// threads, cached when on more. On the H200 host (16 CPUs), pageable
  /// buffers staged by one thread (64 KiB) went at 0.91 of the pinned copy
  /// with streaming stores and 0.65 with cached; on 16 threads cached stores
  /// led at 1, 16 and 256 MiB (1.00, 0.88-0.90, 0.79-0.86 against 0.88, 0.80,
  /// 0.67-0.70); on 8 threads neither led at every size.
  automatic,
};

/// One copy of a list: `bytes` from `src` to `dst` (not overlapping).
struct copy_job {
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  std::size_t bytes = 0;
};

class parallel_memcpy {
 public:
  /// `helpers` threads besides the caller (0: the caller copies alone).
  /// backend_error when not all of them can be started (those that were
  /// are stopped first).
  explicit parallel_memcpy(std::size_t helpers);
  ~parallel_memcpy();
  parallel_memcpy(const parallel_memcpy&) = delete;
  parallel_memcpy& operator=(const parallel_memcpy&) = delete;

  /// Copies `bytes` from `src` to `dst` (not overlapping); returns when done,
  /// with every store visible to the copy engine.
  void copy(void* dst, const void* src, std::size_t bytes, store_kind stores);
  /// Runs every copy of `jobs` on at most `max_threads` threads (the caller
  /// included; 0 counts as 1); returns when all are done, with every store
  /// visible to the copy engine. `jobs` is read until then. Streaming stores
  /// write only the pieces of min_slice bytes or more; a smaller piece (a
  /// small job, or a job's part at a slice's edge) goes through memcpy.
  void copy_all(std::span<const copy_job> jobs, store_kind stores, std::size_t max_threads = SIZE_MAX);
  /// How many slices the helpers have copied so far (the caller's are not
  /// counted): whether the helpers take part at all.
  [[nodiscard]] std::uint64_t slices_copied_by_helpers() const noexcept {
    return helper_slices_.load(std::memory_order_relaxed);
  }

  // 64 KiB: on the H200 host, groups of 64 KiB pageable batches staged at
  // 0.70-0.76 of the pinned copy with slices of at least 256 KiB (four
  // threads at most for a 1 MiB group), at 0.85-0.96 with 64 KiB.
  static constexpr std::size_t min_slice = std::size_t{64} << 10;
  static constexpr std::size_t narrow_threads = 8;
  static constexpr std::chrono::microseconds spin_window{200};

 private:
  // claim_ packs the current copy's generation (high 32 bits), its number of
  // slices (16 bits) and the next slice to take (low 16): a slice is claimed
  // by a compare-exchange of the whole word, so a helper late from one copy
  // never takes a slice of the next, nor one past the last.
  static constexpr std::uint64_t pack(std::uint32_t generation, std::size_t slices, std::size_t next) noexcept {
    return (std::uint64_t{generation} << 32) | (std::uint64_t{slices} << 16) | next;
  }
  static constexpr std::uint32_t generation_of(std::uint64_t c) noexcept { return static_cast<std::uint32_t>(c >> 32); }
  static constexpr std::size_t slices_of(std::uint64_t c) noexcept { return (c >> 16) & 0xFFFF; }
  static constexpr std::size_t next_of(std::uint64_t c) noexcept { return c & 0xFFFF; }

  // Stops the helpers started and waits for them to end.
  void stop_helpers() noexcept;
  void help(std::size_t index) noexcept;
  // Copies slices of copy `generation` until none is left to take (counted
  // in helper_slices_ when `by_helper`).
  void take_slices(std::uint32_t generation, bool by_helper) noexcept;
  static void copy_slice(std::byte* to, const std::byte* from, std::size_t n, store_kind stores) noexcept;
  // Copies bytes [begin, end) of the current copies laid end to end.
  void copy_range(std::size_t begin, std::size_t end) const noexcept;

  // The current copy, written by copy() before it publishes the copy in
  // claim_ and not again until every slice is finished; read by a helper
  // only after it claimed a slice.
  std::span<const copy_job> jobs_;
  std::vector<std::size_t> starts_;  // starts_[i]: where jobs_[i] begins, laid end to end
  std::size_t bytes_ = 0, slice_ = 0;
  store_kind stores_ = store_kind::streaming;
  std::uint32_t generation_ = 0;  // the caller's own count

  // Helpers waiting for a copy watch announced_ and stopping_ (written once
  // per copy, once per life), on a line of their own: claim_ and finished_,
  // which every slice writes, are on others.
  alignas(64) std::atomic<std::uint64_t> announced_{0};  // pack(generation, slices, 0) of the current copy
  std::atomic<bool> stopping_{false};
  alignas(64) std::atomic<std::uint64_t> claim_{0};
  alignas(64) std::atomic<std::size_t> finished_{0};
  std::mutex sleep_mutex_;  // guards the sleeper counts; helpers sleep under it
  std::condition_variable work_, wide_work_;  // narrow helpers sleep on work_, wide ones on wide_work_
  std::size_t sleepers_ = 0, wide_sleepers_ = 0;
  // Slices helpers copied, counted before each is finished; on a line of its
  // own, away from the sleepers' counts a copy reads.
  alignas(64) std::atomic<std::uint64_t> helper_slices_{0};
  std::vector<std::thread> helpers_;
};

}  // namespace shoal::transfer
