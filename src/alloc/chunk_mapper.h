// The chunk mapper: every device call a growable segment makes after its
// range is reserved — physical chunks created, mapped, unmapped and
// released — and the count of each (stats().vmm_calls).
//
// A segment's mappings are recorded in its slots (block.h):
//   s.chunks[k] = the physical chunk mapped over slot k (native 0: none),
//   s.mapping_slots[h] = the slot count of the mapping that starts at h.
// Between calls every chunk it holds is mapped:
//   held_bytes() = sum of mapped_bytes over the growable segments.
// Unmapped chunks kept for re-mapping (spare_chunks) live only inside one
// growth: map() takes them all, mapping those that fit and releasing the
// rest before it creates anything, so the device never holds more than the
// reserved total before or after the growth (docs/architecture.md).
// Thread-safety: map and unmap run under the lock of the segment's pool
// (a sibling's chunks are unmapped under its lock, then the spares are the
// growth's alone); the counters are relaxed atomics, read from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "alloc/block.h"
#include "shoal/alloc/stats.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

/// Physical chunks unmapped by one growth's give-back, still held, for the
/// growth to map again where its block goes.
using spare_chunks = std::vector<backend::sized_chunk>;

class chunk_mapper {
 public:
  explicit chunk_mapper(backend::device& device) : device_(device) {}
  chunk_mapper(const chunk_mapper&) = delete;
  chunk_mapper& operator=(const chunk_mapper&) = delete;

  /// Maps [at, at + bytes) of growable segment `s` (granularity-aligned,
  /// unmapped) in one map_chunks call (one access grant for the range), cut
  /// into chunks of growable_mapping_max (growable_ramp_mapping_max until
  /// `s` first gave memory back) and a last one for the rest; a
  /// chunk of `spare` of a piece's exact size serves it, new chunks the
  /// others. Leaves `spare` empty whatever happens (std::bad_alloc and
  /// device errors included): the spares not used are released before any
  /// chunk is created. False, with nothing mapped and nothing kept, when
  /// the device is out of memory.
  bool map(segment& s, std::uintptr_t at, std::size_t bytes, spare_chunks& spare);
  /// Unmaps the mappings of `s` that start at or after `lo` and end at or
  /// before `hi` (the caller passes whole mappings), in address order. Their
  /// chunks go to `keep` where given, else they are released. An unmap that
  /// fails is rethrown with the mappings before it unmapped and recorded so,
  /// and it and those after it still mapped (first_mapped finds where).
  void unmap(segment& s, std::uintptr_t lo, std::uintptr_t hi, spare_chunks* keep);
  /// The start of the first mapping of `s` in [lo, hi), or hi if none.
  [[nodiscard]] std::uintptr_t first_mapped(const segment& s, std::uintptr_t lo, std::uintptr_t hi) const;
  /// Unmaps and releases every mapping of `s`, going on past any that
  /// fails (a segment's teardown).
  void unmap_for_teardown(segment& s) noexcept;
  /// Releases the chunks of `spare` and empties it; one release failing
  /// does not keep the others from going back (the first failure is
  /// rethrown after them).
  void release(spare_chunks& spare);

  /// Bytes of the physical chunks created and not yet released.
  [[nodiscard]] std::size_t held_bytes() const noexcept { return held_bytes_.load(std::memory_order_relaxed); }
  [[nodiscard]] vmm_call_counts counts() const noexcept;
  void reset_counts() noexcept;

 private:
  /// Unmaps the one mapping that starts at slot `i`, its chunk going to
  /// `keep` or released; returns its slot count.
  std::size_t unmap_at(segment& s, std::size_t i, spare_chunks* keep);
  backend::physical_ref create(std::size_t bytes);
  void release(const backend::sized_chunk& chunk);
  /// Releases the chunks given that hold one (native != 0), all of them
  /// even when one fails; the first failure is rethrown after.
  void release_all(std::span<const backend::sized_chunk> chunks);
  /// release_all, its failure dropped (while another error is on its way).
  void release_all_quietly(std::span<const backend::sized_chunk> chunks) noexcept;

  backend::device& device_;
  std::atomic<std::size_t> held_bytes_{0};
  std::atomic<std::int64_t> creates_{0}, releases_{0}, maps_{0}, unmaps_{0}, access_grants_{0};
};

}  // namespace shoal::alloc::detail
