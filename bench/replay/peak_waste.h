// Where a replay's peak reserved memory went. The allocator reports the sum
// of its pools' peaks, so each pool (small, large) is looked at when its own
// reserved bytes reach their high: a snapshot of that pool, its bytes sorted
// by reason:
//
//   reserved = requested + rounding + free_split + free_idle + free_growable
//            + pending
// where rounding is what allocated blocks hold beyond their request (512-byte
// rounding, and unsplit rests of large blocks), free_split the free blocks of
// segments in use, free_idle wholly free segments, free_growable free mapped
// blocks of a growable range, and pending blocks freed but waiting for
// another stream.
//
// Thread-safety: drives one allocator from the calling thread.
#pragma once

#include <cstddef>
#include <string>

#include "bench/replay/trace.h"
#include "shoal/alloc/config.h"
#include "shoal/backend/device.h"

namespace shoal::bench {

/// One pool kind (all streams' pools of it) at its peak.
struct pool_waste {
  std::size_t event = 0;  ///< index of the event after which the peak was reached
  std::size_t reserved = 0, requested = 0, rounding = 0, pending = 0;
  std::size_t free_split = 0, free_idle = 0, free_growable = 0;
  std::size_t segments = 0;
  std::size_t largest_free = 0;  ///< the largest free block
};

struct peak_waste {
  pool_waste small, large;
};

/// Replays `t` through a fresh caching allocator with `config` on `device`
/// (slowly: a stats read after every allocation) and reports its peaks.
[[nodiscard]] peak_waste analyse_peak(const trace& t, const alloc::allocator_config& config,
                                      backend::device& device);

/// Two markdown rows (small pool, large pool): the figures above in MiB.
[[nodiscard]] std::string waste_rows(const std::string& name, const peak_waste& w);
/// The header for waste_row's rows.
[[nodiscard]] std::string waste_header();

}  // namespace shoal::bench
