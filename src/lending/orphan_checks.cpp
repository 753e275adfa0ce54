#include "lending/orphan_checks.h"

#include <algorithm>
#include <tuple>
#include <utility>

namespace shoal::lending::detail {

namespace {

bool earlier(const process_identity& a, const process_identity& b) noexcept {
  return std::tie(a.pid, a.start_time) < std::tie(b.pid, b.start_time);
}

std::function<void(std::span<const process_identity>)>& lookups_hook() noexcept {
  static std::function<void(std::span<const process_identity>)> hook;
  return hook;
}

}  // namespace

std::vector<process_identity> orphan_checks::next(std::vector<process_identity>& holders) {
  std::sort(holders.begin(), holders.end(), earlier);
  holders.erase(std::unique(holders.begin(), holders.end()), holders.end());
  const std::size_t n = holders.size();
  const auto after_last = last_ ? std::upper_bound(holders.begin(), holders.end(), *last_, earlier) : holders.begin();
  const auto from = static_cast<std::size_t>(after_last - holders.begin());
  std::vector<process_identity> out;
  out.reserve(std::min(n, per_pass_));
  for (std::size_t i = 0; i < std::min(n, per_pass_); ++i) out.push_back(holders[(from + i) % n]);
  if (!out.empty()) last_ = out.back();
  return out;
}

void set_before_orphan_lookups(std::function<void(std::span<const process_identity>)> hook) {
  lookups_hook() = std::move(hook);
}

const std::function<void(std::span<const process_identity>)>& before_orphan_lookups() noexcept {
  return lookups_hook();
}

}  // namespace shoal::lending::detail
