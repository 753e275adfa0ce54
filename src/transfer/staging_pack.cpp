#include "transfer/staging_pack.h"

#include <algorithm>

namespace shoal::transfer {

staging_pack::staging_pack(alloc::caching_allocator& pinned, backend::stream_ref stream, std::size_t block_bytes,
                           std::size_t total_bytes, parallel_memcpy& memcpy, store_kind stores)
    : pinned_(pinned),
      device_(pinned.device()),
      stream_(stream),
      block_bytes_(block_bytes),
      still_to_stage_(total_bytes),
      memcpy_(memcpy),
      stores_(stores) {}

staging_pack::~staging_pack() { give_back(); }

void staging_pack::stage(void* dst, const host_buffer& source) {
  const std::size_t needed = footprint(source.bytes);
  if (used_ + needed > capacity_) {
    give_back();
    // Handed out only once the copies that last read it have run (the
    // pinned allocator's rule); past max_pinned_bytes it waits for them.
    const std::size_t capacity = std::clamp(still_to_stage_, needed, block_bytes_);
    block_ = static_cast<std::byte*>(pinned_.allocate(capacity, stream_));
    capacity_ = capacity;
  }
  std::byte* staging = block_ + used_;
  memcpy_.copy(staging, source.data, source.bytes, stores_);
  used_ += needed;  // before the copy: a failed copy's bytes are not reused in this block
  still_to_stage_ -= std::min(still_to_stage_, needed);
  device_.copy(stream_, dst, staging, source.bytes);
}

void staging_pack::give_back() noexcept {
  if (block_ == nullptr) return;
  try {
    pinned_.deallocate(block_, stream_);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a block the allocator refuses stays with it until it is destroyed
  }
  block_ = nullptr;
  capacity_ = used_ = 0;
}

}  // namespace shoal::transfer
