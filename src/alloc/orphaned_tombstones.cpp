#include "alloc/orphaned_tombstones.h"

#include <algorithm>

namespace shoal::alloc::detail {

void orphaned_tombstones::reserve(std::size_t n) {
  std::lock_guard lock(mutex_);
  addresses_.reserve(addresses_.size() + n);
}

void orphaned_tombstones::add(std::uintptr_t address) noexcept {
  std::lock_guard lock(mutex_);
  addresses_.push_back(address);  // within the capacity reserve made
  count_.store(addresses_.size(), std::memory_order_relaxed);
}

bool orphaned_tombstones::forget(std::uintptr_t address) {
  std::lock_guard lock(mutex_);
  const auto it = std::find(addresses_.begin(), addresses_.end(), address);
  if (it == addresses_.end()) return false;
  *it = addresses_.back();
  addresses_.pop_back();
  count_.store(addresses_.size(), std::memory_order_relaxed);
  return true;
}

bool orphaned_tombstones::contains(std::uintptr_t address) const {
  std::lock_guard lock(mutex_);
  return std::find(addresses_.begin(), addresses_.end(), address) != addresses_.end();
}

std::size_t orphaned_tombstones::count_within(std::uintptr_t low, std::uintptr_t high, std::size_t step) const {
  if (count_.load(std::memory_order_relaxed) == 0) return 0;
  std::lock_guard lock(mutex_);
  return static_cast<std::size_t>(std::count_if(addresses_.begin(), addresses_.end(), [&](std::uintptr_t a) {
    return a >= low && a < high && (a - low) % step == 0;
  }));
}

std::vector<std::uintptr_t> orphaned_tombstones::within(std::uintptr_t low, std::uintptr_t high) const {
  std::lock_guard lock(mutex_);
  std::vector<std::uintptr_t> found;
  for (auto a : addresses_) {
    if (a >= low && a < high) found.push_back(a);
  }
  std::sort(found.begin(), found.end());
  return found;
}

void orphaned_tombstones::forget_all(const std::vector<std::uintptr_t>& addresses) noexcept {
  std::lock_guard lock(mutex_);
  std::erase_if(addresses_, [&](std::uintptr_t a) {
    return std::find(addresses.begin(), addresses.end(), a) != addresses.end();
  });
  count_.store(addresses_.size(), std::memory_order_relaxed);
}

std::size_t orphaned_tombstones::take_within(std::uintptr_t low, std::uintptr_t high, std::size_t step,
                                             std::span<std::uintptr_t> into) noexcept {
  std::lock_guard lock(mutex_);
  std::size_t n = 0;
  for (auto a : addresses_) {
    if (n < into.size() && a >= low && a < high && (a - low) % step == 0) into[n++] = a;
  }
  if (n == 0) return 0;
  const auto taken = into.first(n);
  std::sort(taken.begin(), taken.end());
  std::erase_if(addresses_, [&](std::uintptr_t a) { return std::binary_search(taken.begin(), taken.end(), a); });
  count_.store(addresses_.size(), std::memory_order_relaxed);
  return n;
}

}  // namespace shoal::alloc::detail
