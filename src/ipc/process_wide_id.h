// Ids of the resources a producer announces (counter files, segments),
// unique in the process: a consumer keeps one table per producer process,
// whichever of its sharing contexts and connections an announcement came on.
#pragma once

#include <atomic>
#include <cstdint>

namespace shoal::ipc::detail {

/// A new id, never 0 and never given out before in this process.
inline std::uint64_t next_process_wide_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace shoal::ipc::detail
