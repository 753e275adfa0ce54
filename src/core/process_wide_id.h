// Ids unique in the process, for things other processes name: event sources
// (backend), counter files and segments a producer announces (ipc). Never 0,
// never reused, so a stale id can never be mistaken for a newer object's,
// and a consumer can keep one table per producer process whichever context
// or connection an id came on.
#pragma once

#include <atomic>
#include <cstdint>

namespace shoal::detail {

/// A new id, never 0 and never given out before in this process.
inline std::uint64_t next_process_wide_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace shoal::detail
