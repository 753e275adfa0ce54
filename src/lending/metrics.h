// The lender's status in the Prometheus text exposition format (version
// 0.0.4): gauges for what is lent now, counters since the start.
#pragma once

#include <cstddef>
#include <string>

#include "shoal/lending/lending_types.h"

namespace shoal::lending::detail {

/// The text, at most `max_bytes` long when that leaves room for the totals
/// and headers (about 4 KiB, written always), then a
/// sample per region, per shared hold and per spare chunk while they fit.
/// Those left out are counted in shoal_lending_samples_left_out{series=...}
/// and named in a "# truncated" comment; the totals still count them.
[[nodiscard]] std::string prometheus_text(const lender_status& status, std::size_t max_bytes);

}  // namespace shoal::lending::detail
