// Test helpers for the caching allocator: a fixture per backend and a few
// ways to look at what the allocator holds.
#pragma once

#include <memory>

#include "shoal/alloc/caching_allocator.h"
#include "support/backends.h"

namespace shoal::testing {

template <class Backend>
class allocator_test : public backend_test<Backend> {
 public:
  /// A fresh allocator on the backend's device with `conf` (SHOAL_ALLOC_CONF text).
  alloc::caching_allocator& make(const std::string& conf = "") {
    allocator_ = std::make_unique<alloc::caching_allocator>(this->device(), alloc::allocator_config::parse(conf));
    return *allocator_;
  }
  void TearDown() override { allocator_.reset(); }

 protected:
  std::unique_ptr<alloc::caching_allocator> allocator_;
};

/// Segments in a snapshot, and blocks in a given state.
inline std::size_t count_blocks(const alloc::snapshot& s, alloc::block_state state) {
  std::size_t n = 0;
  for (const auto& seg : s.segments) {
    for (const auto& b : seg.blocks) n += b.state == state ? 1 : 0;
  }
  return n;
}

/// Every "current" statistic of blocks in use is zero.
inline ::testing::AssertionResult nothing_in_use(const alloc::allocator_stats& s) {
  for (const auto* stat : {&s.allocations, &s.active, &s.allocated_bytes, &s.active_bytes, &s.requested_bytes}) {
    if (stat->aggregate.current != 0) {
      return ::testing::AssertionFailure() << "a block statistic is still " << stat->aggregate.current << ": "
                                           << s.to_json();
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace shoal::testing
