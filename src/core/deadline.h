// Deadlines and timeouts from durations a caller gives (sharing options,
// receive_for), saturating: a duration too long for the clock, such as
// std::chrono::milliseconds::max(), means "no sooner than the clock's end"
// instead of overflowing into a deadline in the past.
#pragma once

#include <algorithm>
#include <chrono>

namespace shoal::detail {

/// now + timeout; now for a negative timeout; the clock's last time point
/// where the sum would pass it.
[[nodiscard]] inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) noexcept {
  const auto now = std::chrono::steady_clock::now();
  if (timeout <= std::chrono::milliseconds(0)) return now;
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::time_point::max() - now);
  return timeout >= room ? std::chrono::steady_clock::time_point::max() : now + timeout;
}

/// A timeout for the channel layer, which adds it to its clock in
/// nanoseconds: at most a year (a longer one expires no sooner in practice).
[[nodiscard]] inline std::chrono::milliseconds channel_timeout(std::chrono::milliseconds timeout) noexcept {
  constexpr std::chrono::milliseconds longest = std::chrono::hours(24 * 365);
  return std::clamp(timeout, std::chrono::milliseconds(0), longest);
}

/// A spin for the channel layer, added to its clock as it starts: from 0 to
/// a year, like channel_timeout.
[[nodiscard]] inline std::chrono::nanoseconds channel_spin(std::chrono::nanoseconds spin) noexcept {
  constexpr std::chrono::nanoseconds longest = std::chrono::hours(24 * 365);
  return std::clamp(spin, std::chrono::nanoseconds(0), longest);
}

}  // namespace shoal::detail
