// Value types of the caching allocator (caching_allocator.h) that its
// observers and pools are named by. Plain values.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shoal/backend/types.h"

namespace shoal::alloc {

/// What an out-of-memory observer is told before out_of_memory is thrown.
struct oom_report {
  std::size_t requested_bytes = 0;
  std::size_t device_free_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t allocated_bytes = 0;
  std::size_t largest_free_block = 0;
  backend::stream_ref stream;
};

/// A private pool: memory handed in from outside, split into named
/// sub-pools. Identified by the id create_private_pool returns.
struct private_pool_id {
  std::uint64_t value = 0;
  friend bool operator==(private_pool_id, private_pool_id) = default;
};

}  // namespace shoal::alloc
