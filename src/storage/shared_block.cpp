#include "storage/shared_block.h"

namespace shoal::storage::detail {

shared_block::~shared_block() {
  try {
    allocator_.deallocate_or_wait(block_, stream_);
  } catch (...) {  // NOLINT(bugprone-empty-catch)
    // As for a storage's own block (storage.cpp): a refused free leaves the
    // block allocated, visible in the allocator's statistics, rather than
    // reused unsafely.
  }
}

void shared_block::storage_released(std::span<const backend::stream_ref> used_on) noexcept {
  for (const backend::stream_ref s : used_on) {
    try {
      allocator_.record_stream(block_, s);  // the block's own stream is skipped by the allocator
    } catch (...) {
      // No memory to remember the stream: wait for it here instead, so the
      // free cannot overtake it.
      try {
        allocator_.device().synchronize(s);
      } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
      }
    }
  }
}

}  // namespace shoal::storage::detail
