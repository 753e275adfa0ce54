#include "lending/mapping_cache.h"

namespace shoal::lending::detail {

mapping_cache::~mapping_cache() {
  for (const auto& [memory, m] : mappings_) {
    try {
      device_.close_import(m.data);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the process keeps only address space it no longer uses
    }
  }
}

void mapping_cache::keep(std::uint64_t memory, mapping m) {
  mappings_.emplace(memory, m);
  bytes_ += m.size;
}

std::optional<mapping_cache::mapping> mapping_cache::take(std::uint64_t memory) {
  const auto it = mappings_.find(memory);
  if (it == mappings_.end()) return std::nullopt;
  const mapping m = it->second;
  mappings_.erase(it);
  bytes_ -= m.size;
  return m;
}

bool mapping_cache::forget(std::uint64_t memory) noexcept {
  const auto m = take(memory);
  if (!m) return false;
  try {
    device_.close_import(m->data);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the process keeps only address space it no longer uses
  }
  return true;
}

}  // namespace shoal::lending::detail
