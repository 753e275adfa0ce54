// The allocator's trace: a ring of the last N events (allocations, frees,
// segments taken and given back, out-of-memory), N = config.trace_entries.
//
// Invariant: entries_.size() = N, fixed at construction; next_ < N is where
// the next event goes; entries [next_, N) are older than [0, next_) once
// wrapped_, and unwritten before.
// Thread-safety: note and entries may be called from any thread at once
// (a mutex, a leaf of the allocator's lock order); enabled() reads only
// what construction fixed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "shoal/alloc/stats.h"

namespace shoal::alloc::detail {

class trace_ring {
 public:
  explicit trace_ring(std::size_t entries) : entries_(entries) {}

  /// False when the trace is off (N = 0): callers skip note() altogether.
  [[nodiscard]] bool enabled() const noexcept { return !entries_.empty(); }
  /// Records an event now (enabled() only).
  void note(trace_action action, std::uintptr_t address, std::size_t size, backend::stream_ref stream) noexcept;
  /// The ring, oldest first.
  [[nodiscard]] std::vector<trace_entry> entries() const;

 private:
  mutable std::mutex mutex_;
  std::vector<trace_entry> entries_;  // guarded by mutex_ (its size is fixed)
  std::size_t next_ = 0;              // guarded by mutex_
  bool wrapped_ = false;              // guarded by mutex_
};

}  // namespace shoal::alloc::detail
