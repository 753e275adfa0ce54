#include "transfer/staging_frees.h"

#include <new>
#include <vector>

namespace shoal::transfer {

staging_frees::staging_frees(alloc::caching_allocator& pinned, backend::stream_ref stream)
    : pinned_(pinned), stream_(stream) {
  refused_.reserve(reserved_blocks);
}

bool staging_frees::try_free(void* block) noexcept {
  try {
    pinned_.deallocate(block, stream_);
    return true;
  } catch (const std::bad_alloc&) {
    return false;  // still allocated: free it again later
  } catch (...) {
    // The allocator's own error (not its block): nothing to free again.
    return true;
  }
}

void staging_frees::free(void* block) noexcept {
  if (try_free(block)) return;
  if (refused_.size() < refused_.capacity()) {
    refused_.push_back(block);  // within the room taken: no allocation
    return;
  }
  try {
    refused_.push_back(block);
  } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): kept by the allocator until it goes (see the header)
  }
}

bool staging_frees::retry() noexcept {
  if (refused_.empty()) return false;
  std::erase_if(refused_, [this](void* block) { return try_free(block); });
  return !refused_.empty();
}

}  // namespace shoal::transfer
