#include "lending/preemption.h"

#include <algorithm>

namespace shoal::lending::detail {

std::vector<std::uint64_t> choose_preempted(std::vector<preemption_candidate> candidates, std::size_t shortfall) {
  std::vector<std::uint64_t> chosen;
  if (shortfall == 0) return chosen;
  std::sort(candidates.begin(), candidates.end(), [](const preemption_candidate& a, const preemption_candidate& b) {
    if (a.lent_since != b.lent_since) return a.lent_since < b.lent_since;
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    return a.region < b.region;
  });
  std::size_t covered = 0;
  for (const auto& c : candidates) {
    if (covered >= shortfall) break;
    chosen.push_back(c.region);
    covered += c.bytes;
  }
  if (covered < shortfall) chosen.clear();
  return chosen;
}

}  // namespace shoal::lending::detail
