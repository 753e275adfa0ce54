#include "alloc/invalidated_blocks.h"

namespace shoal::alloc::detail {

void invalidated_blocks::add(std::uintptr_t address) {
  std::lock_guard lock(mutex_);
  ++frees_owed_[address];
  count_.fetch_add(1, std::memory_order_relaxed);
}

bool invalidated_blocks::absorb_free(std::uintptr_t address) {
  std::lock_guard lock(mutex_);
  const auto it = frees_owed_.find(address);
  if (it == frees_owed_.end()) return false;
  if (--it->second == 0) frees_owed_.erase(it);
  count_.fetch_sub(1, std::memory_order_relaxed);
  return true;
}

}  // namespace shoal::alloc::detail
