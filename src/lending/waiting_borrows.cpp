#include "lending/waiting_borrows.h"

#include <algorithm>

namespace shoal::lending::detail {

namespace {

auto of(std::uint64_t serial) {
  return [serial](const waiting_borrow& w) { return w.serial == serial; };
}

}  // namespace

bool waiting_borrows::first_waits() const noexcept {
  return std::any_of(line_.begin(), line_.end(), [](const waiting_borrow& w) { return !w.behind; });
}

const waiting_borrow& waiting_borrows::head() const noexcept {
  const auto it = std::find_if(line_.begin(), line_.end(), [](const waiting_borrow& w) { return !w.behind; });
  return it != line_.end() ? *it : line_.front();
}

bool waiting_borrows::marked_behind(uid_t uid) const noexcept {
  return std::any_of(line_.begin(), line_.end(), [uid](const waiting_borrow& w) { return w.behind && w.uid == uid; });
}

const waiting_borrow* waiting_borrows::find(std::uint64_t serial) const noexcept {
  const auto it = std::find_if(line_.begin(), line_.end(), of(serial));
  return it != line_.end() ? &*it : nullptr;
}

std::optional<waiting_borrow> waiting_borrows::take(std::uint64_t serial) noexcept {
  const auto it = std::find_if(line_.begin(), line_.end(), of(serial));
  if (it == line_.end()) return std::nullopt;
  std::optional<waiting_borrow> taken(std::move(*it));
  line_.erase(it);
  return taken;
}

std::vector<waiting_borrow> waiting_borrows::take_expired(std::chrono::steady_clock::time_point now) {
  std::vector<waiting_borrow> expired;
  const auto over = [&](const waiting_borrow& w) { return now >= w.until; };
  expired.reserve(static_cast<std::size_t>(std::count_if(line_.begin(), line_.end(), over)));
  for (auto& w : line_) {
    if (over(w)) expired.push_back(std::move(w));
  }
  std::erase_if(line_, over);  // a moved-from entry keeps its `until`
  return expired;
}

std::optional<std::chrono::steady_clock::time_point> waiting_borrows::next_expiry() const noexcept {
  std::optional<std::chrono::steady_clock::time_point> first;
  for (const auto& w : line_) first = first ? std::min(*first, w.until) : w.until;
  return first;
}

}  // namespace shoal::lending::detail
