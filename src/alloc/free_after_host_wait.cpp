// deallocate_or_wait: a free that does not leave its block allocated for
// want of host memory. A free that waits for streams (another stream than
// the block's, streams recorded on it, pinned memory) takes some for its
// events and its place among the pending frees; refused, deallocate throws
// std::bad_alloc with nothing changed. An owner that must let go (a
// destructor) then has no way left but this one: wait on the host for every
// stream the free would have waited for, outside the pool's lock, and free
// the block as one whose uses have all run.
#include <array>
#include <cstddef>
#include <cstdint>
#include <new>

#include "alloc/allocator_core.h"

namespace shoal::alloc::detail {

void allocator_core::deallocate_or_wait(void* ptr, backend::stream_ref stream) {
  try {
    deallocate(ptr, stream);
    return;
  } catch (const std::bad_alloc&) {
    // Nothing changed: the block is still allocated (or a tombstone).
  }
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  // The streams to wait for — the freeing one, the block's own (a hand-out
  // on another stream would otherwise wait for an event), those recorded on
  // it — taken a few at a time under the pool's lock and waited for outside
  // it, without heap memory. Only the owner records streams on its block, and
  // it is here: the list does not change between the looks.
  std::array<backend::stream_ref, 8> streams{};
  for (std::size_t next = 0, total = 1; next < total;) {
    std::size_t count = 0;
    const bool found = run_on_block(address, [&](block_pool&, block* b) {
      total = 2 + b->used_on.size();
      for (; next < total && count < streams.size(); ++next) {
        streams[count++] = next == 0 ? stream : next == 1 ? b->stream : b->used_on[next - 2];
      }
    });
    if (!found) throw std::bad_alloc();  // an orphaned tombstone's late free: nothing here to free
    for (std::size_t i = 0; i < count; ++i) device.synchronize(streams[i]);
  }
  // The owner has not let go, so the block is still its own: found again —
  // unless a forced clear and its pool's end made it an orphaned tombstone
  // meanwhile, whose late free deallocate knows (and which needs no memory).
  const bool freed = run_on_block(address, [&](block_pool& pool, block* b) {
    if (b->state == block_state::invalidated) {
      remove_tombstone(pool, b, stream);
    } else {
      free_idle(pool, b, stream);
    }
  });
  if (!freed) {
    deallocate(ptr, stream);
    return;
  }
  check_step();
}

}  // namespace shoal::alloc::detail
