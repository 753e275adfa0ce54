// Which regions the lender revokes for the borrow at the head of its
// waiting line (lender_config::preempt_after): the next model's turn.
//
// Choice: lent longest ago first — the borrower that has had its memory
// longest gives first (regions lent at the same moment: the larger first,
// fewer revocations) — and only as many as the shortfall needs. When every
// candidate together cannot cover it (orphaned regions, shared ones, the
// waiting borrowers' own hold the rest), none is revoked: revoking would
// stop other borrowers' work and still not serve the head.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace shoal::lending::detail {

struct preemption_candidate {
  std::uint64_t region = 0;
  std::size_t bytes = 0;
  std::chrono::steady_clock::time_point lent_since;
};

/// The regions of `candidates` to revoke so that at least `shortfall` bytes
/// come back, in the order above; empty when `shortfall` is 0 or all of
/// them together hold less.
[[nodiscard]] std::vector<std::uint64_t> choose_preempted(std::vector<preemption_candidate> candidates,
                                                          std::size_t shortfall);

}  // namespace shoal::lending::detail
