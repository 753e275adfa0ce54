// The default of the lending layer's spins (borrower_options::reply_spin,
// lender_config::poll_spin): a thread that polls instead of sleeping pays
// only where it leaves the other side a core of its own.
//
// Thread-safety: none needed (reads the calling thread's CPU affinity).
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstddef>

namespace shoal::lending::detail {

/// The CPUs this process may run on (1 where the affinity cannot be read).
inline int usable_cpus() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  return ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
}

/// `asked`, or where it is `automatic`: 50 us where this process may run on
/// at least 8 CPUs, none on fewer.
inline std::chrono::microseconds spin_or_automatic(std::chrono::microseconds asked,
                                                   std::chrono::microseconds automatic) {
  if (asked != automatic) return std::max(asked, std::chrono::microseconds(0));
  return usable_cpus() >= 8 ? std::chrono::microseconds(50) : std::chrono::microseconds(0);
}

/// The most borrowers the lender may have connected and still spin: each of
/// them may spin for its own reply, and a lender that never sleeps loses the
/// scheduler's wake-up preference, so with more spinners than cores it waits
/// whole time slices behind them (a long tail). Half the CPUs, at least one.
inline std::size_t spinning_borrowers_limit() { return static_cast<std::size_t>(std::max(1, usable_cpus() / 2)); }

}  // namespace shoal::lending::detail
