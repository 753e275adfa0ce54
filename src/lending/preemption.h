// Which regions the lender revokes for the borrow at the head of its
// waiting line (lender_config::preempt_after): the next model's turn.
//
// Choice: region by region, lent longest ago first (regions lent at the same
// moment: the larger first, fewer revocations), and only as many as the
// shortfall needs. Across uids, a region is taken only while its uid still
// holds more than the head's uid — counting what this choice has taken from
// the one and given to the other so far — so a borrower evens holdings out
// at most, and never takes from a uid that holds as little as its own. When
// what may be taken cannot cover the shortfall, none is revoked: revoking
// would stop other borrowers' work and still not serve the head.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace shoal::lending::detail {

struct preemption_candidate {
  std::uint64_t region = 0;
  std::size_t bytes = 0;
  std::chrono::steady_clock::time_point lent_since;
  uid_t uid = 0;  ///< its borrower's
};

/// The bytes each uid holds (lent, orphaned, shared — once per uid — and
/// spares it keeps mapped).
using holdings = std::vector<std::pair<uid_t, std::size_t>>;

/// `uid`'s entry of `h`, added at 0 when it has none (may move the others).
std::size_t& holding_of(holdings& h, uid_t uid);

/// The regions of `candidates` to revoke so that at least `shortfall` bytes
/// come back for a borrow of uid `head_uid`, in the order and under the
/// rule above, `held` being what each uid holds now; empty when `shortfall`
/// is 0 or what may be taken holds less.
[[nodiscard]] std::vector<std::uint64_t> choose_preempted(std::vector<preemption_candidate> candidates,
                                                          std::size_t shortfall, uid_t head_uid,
                                                          const holdings& held);

}  // namespace shoal::lending::detail
