#include "shoal/lending/adopted_region.h"

#include <memory>
#include <mutex>
#include <vector>

#include "shoal/core/error.h"

namespace shoal::lending {

namespace {

/// Regions kept mapped for the process's life because blocks were still
/// allocated in them when their adopted_region went. Never destroyed (the
/// blocks may be used until exit).
void keep_for_life(borrowed_region region) {
  static std::mutex mutex;
  static auto* kept = new std::vector<borrowed_region>();  // NOLINT(cppcoreguidelines-owning-memory)
  std::lock_guard lock(mutex);
  kept->push_back(std::move(region));
}

}  // namespace

adopted_region::adopted_region(alloc::caching_allocator& allocator, borrowed_region region,
                               const std::vector<std::pair<std::string, std::size_t>>& parts)
    : allocator_(allocator), region_(std::move(region)) {
  if (!region_.valid()) throw invalid_argument("adopted_region: the region is empty (moved from or given back)");
  pool_ = allocator_.create_private_pool(region_.data(), region_.size(), parts);
}

adopted_region::~adopted_region() {
  if (!region_.valid()) return;
  try {
    (void)release();  // the region goes back to the lender as it is destroyed here
  } catch (const device_unavailable&) {
    // A fork() child (the allocator refuses its pool's calls there): the
    // region and its pool are the parent's; the region's drop does nothing.
    return;
  } catch (...) {
    // Blocks still allocated: they must stay valid, so the mapping does too.
    try {
      keep_for_life(std::move(region_));
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory left even to remember it (the region then goes back)
    }
  }
}

alloc::invalidated_blocks_report adopted_region::clear(const std::string& part, alloc::live_blocks live) {
  if (!region_.valid()) throw invalid_argument("adopted_region::clear: the region was released");
  // Refusing drains the part first, and again after a free during the wait;
  // a forced clear waits for the whole device instead.
  return allocator_.clear_private_pool(pool_, part, live);
}

borrowed_region adopted_region::release(alloc::live_blocks live, alloc::invalidated_blocks_report* invalidated) {
  if (!region_.valid()) throw invalid_argument("adopted_region::release: the region was released already");
  // Refusing drains every part first (as clear does) and names the live
  // blocks, changing nothing, when any is allocated.
  auto taken = allocator_.destroy_private_pool(pool_, live);
  if (invalidated != nullptr) *invalidated = std::move(taken);
  return std::move(region_);
}

}  // namespace shoal::lending
