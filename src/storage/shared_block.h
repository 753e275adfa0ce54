// The owner of one allocator block whose parts are storages of their own
// (storage::allocate_parts): each part hands it the streams it was used on
// when its last handle goes, and the block is freed, on the stream it was
// allocated on, when the last part has let go of the owner.
//
// Why this is safe for parts released on different streams: a part's
// release records each of its streams on the block with the allocator's
// record_stream, and the allocator's free waits for every recorded stream
// by an event recorded at the free, which comes after that release. So
// when part A goes on stream A while part B is still read on stream B, the
// block is freed only once B's handle is gone (B's streams recorded then)
// and each of A's and B's streams has passed the free.
// Invariant: freed exactly once, by the destructor (the last part gone).
//
// Thread-safety: storage_released may be called from several threads at
// once (the allocator's record_stream is thread-safe).
#pragma once

#include <span>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/storage/storage.h"

namespace shoal::storage::detail {

class shared_block final : public storage_owner {
 public:
  /// Takes over `block`, which `allocator` handed out on `stream`.
  shared_block(alloc::caching_allocator& allocator, void* block, backend::stream_ref stream) noexcept
      : allocator_(allocator), block_(block), stream_(stream) {}
  /// Frees the block on its own stream, after every stream recorded on it.
  ~shared_block() override;

  void storage_released(std::span<const backend::stream_ref> used_on) noexcept override;

 private:
  alloc::caching_allocator& allocator_;
  void* const block_;
  const backend::stream_ref stream_;
};

}  // namespace shoal::storage::detail
