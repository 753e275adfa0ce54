// Replaying a trace through an allocator: every alloc and free of the trace,
// in order, on one adapter stream per trace stream, measuring how much
// memory the allocator reserved for what the trace asked.
//
// The figure of merit is fragmentation = peak reserved / peak requested:
// peak requested is the most bytes the trace held live at once (sizes as
// asked, unrounded), peak reserved the allocator's own high-water mark of
// device memory. 1.0 is perfect; the allocator's rounding, splitting rules
// and per-stream caches all push it up.
//
// Thread-safety: replay drives the adapter from the calling thread only.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "bench/common/allocator_adapter.h"
#include "bench/replay/trace.h"

namespace shoal::bench {

struct replay_result {
  std::size_t events = 0;
  std::size_t streams = 0;
  std::size_t peak_requested_bytes = 0;  ///< most bytes live at once, as the trace asked
  std::size_t peak_reserved_bytes = 0;   ///< the adapter's peak_reserved_bytes() after the replay
  std::chrono::nanoseconds elapsed{};    ///< wall time of the trace's alloc and free calls
  /// The adapter's device calls during the replay (-1: it does not count them).
  std::int64_t device_allocations = -1, device_frees = -1;
  /// The VMM calls among them (allocator_adapter::vmm_calls).
  std::string vmm_calls = "-";

  /// peak_reserved_bytes / peak_requested_bytes (0 for a trace that never
  /// asks for anything).
  [[nodiscard]] double fragmentation() const noexcept;
};

/// Replays `t` through `allocator`, which must be fresh: its peak reserved
/// must count from before the replay (make one adapter per replay). Blocks
/// the trace leaves live are freed afterwards, outside the timing, and the
/// adapter's streams are destroyed, also when an allocation throws (the
/// exception then propagates, e.g. shoal::out_of_memory).
[[nodiscard]] replay_result replay(const trace& t, allocator_adapter& allocator);

}  // namespace shoal::bench
