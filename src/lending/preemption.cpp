#include "lending/preemption.h"

#include <algorithm>

namespace shoal::lending::detail {

std::size_t& holding_of(holdings& h, uid_t uid) {
  const auto it = std::find_if(h.begin(), h.end(), [&](const auto& e) { return e.first == uid; });
  if (it != h.end()) return it->second;
  return h.emplace_back(uid, 0).second;
}

std::vector<std::uint64_t> choose_preempted(std::vector<preemption_candidate> candidates, std::size_t shortfall,
                                            uid_t head_uid, const holdings& held) {
  std::vector<std::uint64_t> chosen;
  if (shortfall == 0) return chosen;
  std::sort(candidates.begin(), candidates.end(), [](const preemption_candidate& a, const preemption_candidate& b) {
    if (a.lent_since != b.lent_since) return a.lent_since < b.lent_since;
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    return a.region < b.region;
  });
  holdings now = held;  // as this choice moves memory from uid to uid
  std::size_t covered = 0;
  for (const auto& c : candidates) {
    if (covered >= shortfall) break;
    if (c.uid != head_uid) {
      (void)holding_of(now, c.uid);  // both present first: the references below stay valid
      (void)holding_of(now, head_uid);
      std::size_t& theirs = holding_of(now, c.uid);
      std::size_t& ours = holding_of(now, head_uid);
      if (theirs <= ours) continue;  // it holds no more than the head's uid (any more)
      theirs -= std::min(theirs, c.bytes);
      ours += c.bytes;
    }
    chosen.push_back(c.region);
    covered += c.bytes;
  }
  if (covered < shortfall) chosen.clear();
  return chosen;
}

}  // namespace shoal::lending::detail
