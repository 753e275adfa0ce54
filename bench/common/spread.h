// A benchmark's repeated measurements summarized: the median and the range,
// printed as "median (min–max)".
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace shoal::bench {

struct spread {
  double median, min, max;
};

/// The upper median for an even count; `samples` must not be empty.
inline spread summarize(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return {samples[samples.size() / 2], samples.front(), samples.back()};
}

inline std::string text(const spread& s) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.1f (%.1f–%.1f)", s.median, s.min, s.max);
  return buffer;
}

}  // namespace shoal::bench
