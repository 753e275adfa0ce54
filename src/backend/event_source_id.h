// Ids of the event sources devices export (event_point::source_id).
// Internal to src/backend.
#pragma once

#include <atomic>
#include <cstdint>

namespace shoal::backend::detail {

/// A new id: unique among the event sources of this process, never 0, never
/// reused, so a point can never be mistaken for one of an older source.
inline std::uint64_t next_event_source_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace shoal::backend::detail
