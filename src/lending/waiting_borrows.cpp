#include "lending/waiting_borrows.h"

#include <algorithm>

namespace shoal::lending::detail {

namespace {

auto of(std::uint64_t serial) {
  return [serial](const waiting_borrow& w) { return w.serial == serial; };
}

}  // namespace

const waiting_borrow* waiting_borrows::find(std::uint64_t serial) const noexcept {
  for (const auto* line : {&first_, &behind_}) {
    const auto it = std::find_if(line->begin(), line->end(), of(serial));
    if (it != line->end()) return &*it;
  }
  return nullptr;
}

std::optional<waiting_borrow> waiting_borrows::take(std::uint64_t serial) noexcept {
  for (auto* line : {&first_, &behind_}) {
    const auto it = std::find_if(line->begin(), line->end(), of(serial));
    if (it == line->end()) continue;
    std::optional<waiting_borrow> taken(std::move(*it));
    line->erase(it);
    return taken;
  }
  return std::nullopt;
}

std::vector<waiting_borrow> waiting_borrows::take_expired(std::chrono::steady_clock::time_point now) {
  std::vector<waiting_borrow> expired;
  const auto over = [&](const waiting_borrow& w) { return now >= w.until; };
  expired.reserve(static_cast<std::size_t>(std::count_if(first_.begin(), first_.end(), over) +
                                           std::count_if(behind_.begin(), behind_.end(), over)));
  for (auto* line : {&first_, &behind_}) {
    for (auto& w : *line) {
      if (over(w)) expired.push_back(std::move(w));
    }
    std::erase_if(*line, over);  // a moved-from entry keeps its `until`
  }
  return expired;
}

std::optional<std::chrono::steady_clock::time_point> waiting_borrows::next_expiry() const noexcept {
  std::optional<std::chrono::steady_clock::time_point> first;
  visit([&](const waiting_borrow& w) { first = first ? std::min(*first, w.until) : w.until; });
  return first;
}

}  // namespace shoal::lending::detail
