#include "lending/lendable_memory.h"

#include <limits>

namespace shoal::lending::detail {

std::size_t round_up(std::size_t bytes, std::size_t granularity) noexcept {
  if (bytes > std::numeric_limits<std::size_t>::max() - (granularity - 1)) return 0;
  return (bytes + granularity - 1) / granularity * granularity;
}

lendable_memory::lendable_memory(backend::device& device, std::size_t bytes, std::uint64_t id)
    : device_(device), size_(bytes), id_(id) {
  base_ = device.reserve_range(size_);
  try {
    chunk_ = device.create_physical(size_);
    try {
      device.map(base_, chunk_);
      try {
        handle_ = device.export_memory(base_);
      } catch (...) {
        device.unmap(base_);
        throw;
      }
    } catch (...) {
      device.release_physical(chunk_);
      throw;
    }
  } catch (...) {
    device.release_range(base_);
    throw;
  }
}

lendable_memory::~lendable_memory() {
  try {
    device_.unmap(base_);
    device_.release_physical(chunk_);
    device_.release_range(base_);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the handles are ours; a failure leaves only address space behind
  }
}

}  // namespace shoal::lending::detail
