// The chunk mapper: every device call a growable segment makes after its
// range is reserved — physical chunks created, mapped, unmapped and
// released — and the count of each (stats().vmm_calls).
//
// A segment's mappings are recorded in its slots (block.h):
//   s.chunks[k] = the physical chunk mapped over slot k (native 0: none),
//   s.mapping_slots[h] = the slot count of the mapping that starts at h.
// Thread-safety: map and unmap run under the lock of the segment's pool;
// the counters are relaxed atomics, read and reset from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "alloc/block.h"
#include "shoal/alloc/stats.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

class chunk_mapper {
 public:
  explicit chunk_mapper(backend::device& device) : device_(device) {}
  chunk_mapper(const chunk_mapper&) = delete;
  chunk_mapper& operator=(const chunk_mapper&) = delete;

  /// Maps [at, at + bytes) of growable segment `s` (granularity-aligned,
  /// unmapped) with new chunks of at most growable_mapping_max each. False,
  /// with nothing mapped, when the device is out of memory.
  bool map(segment& s, std::uintptr_t at, std::size_t bytes);
  /// Unmaps the mappings of `s` that start at or after `lo` and end at or
  /// before `hi` (the caller passes whole mappings) and releases their chunks.
  void unmap(segment& s, std::uintptr_t lo, std::uintptr_t hi);

  [[nodiscard]] vmm_call_counts counts() const noexcept;
  void reset_counts() noexcept;

 private:
  /// Unmaps the one mapping that starts at slot `i` and releases its chunk;
  /// returns its slot count.
  std::size_t unmap_at(segment& s, std::size_t i);

  backend::device& device_;
  std::atomic<std::int64_t> creates_{0}, releases_{0}, maps_{0}, unmaps_{0}, access_grants_{0};
};

}  // namespace shoal::alloc::detail
