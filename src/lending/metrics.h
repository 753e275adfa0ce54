// The lender's status in the Prometheus text exposition format (version
// 0.0.4): gauges for what is lent now, counters since the start.
#pragma once

#include <string>

#include "shoal/lending/lending_types.h"

namespace shoal::lending::detail {

[[nodiscard]] std::string prometheus_text(const lender_status& status);

}  // namespace shoal::lending::detail
