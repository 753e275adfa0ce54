// Queries that answer from the one pool concerned, or from each ordinary
// pool's bins in turn, without a snapshot: the largest free block cached,
// and the segment of an allocated block.
#include <algorithm>
#include <mutex>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"

namespace shoal::alloc::detail {

std::size_t allocator_core::largest_free_block() const {
  std::size_t largest = 0;
  directory_.look_at_each_pool(false,
                               [&](block_pool& p) noexcept { largest = std::max(largest, largest_free_when_settled(p)); });
  return largest;
}

std::optional<block_segment> allocator_core::segment_of_allocated_block(const void* ptr) const {
  std::optional<block_segment> found;
  (void)run_on_block(reinterpret_cast<std::uintptr_t>(ptr), [&](const block_pool&, const block* b) {
    if (b->state != block_state::allocated) return;  // a tombstone
    const segment& s = *b->owner;
    const segment_kind kind = s.expandable ? segment_kind::growable
                              : s.external ? segment_kind::handed_in
                                           : segment_kind::plain;
    found = block_segment{s.base, s.size, kind};
  });
  return found;
}

}  // namespace shoal::alloc::detail
