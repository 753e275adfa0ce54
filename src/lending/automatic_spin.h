// The default of the lending layer's spins (borrower_options::reply_spin,
// lender_config::poll_spin): a thread that polls instead of sleeping pays
// only where it leaves the other side a core of its own.
//
// Thread-safety: none needed (reads the calling thread's CPU affinity).
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>

namespace shoal::lending::detail {

/// `asked`, or where it is `automatic`: 50 us where this process may run on
/// at least 8 CPUs, none on fewer.
inline std::chrono::microseconds spin_or_automatic(std::chrono::microseconds asked,
                                                   std::chrono::microseconds automatic) {
  if (asked != automatic) return std::max(asked, std::chrono::microseconds(0));
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int usable = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  return usable >= 8 ? std::chrono::microseconds(50) : std::chrono::microseconds(0);
}

}  // namespace shoal::lending::detail
