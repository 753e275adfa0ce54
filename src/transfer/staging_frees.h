// Frees of pinned staging blocks, which the host may refuse.
//
// A pinned free allocates (the block's place among the pending frees, room
// for its shared event) and, refused that memory, throws std::bad_alloc and
// leaves the block allocated. A staging block whose free was refused is kept
// here and freed again later — before the next staging block is taken,
// each time the engine's thread looks for finished copies, at its end —
// instead of staying allocated for
// the engine's life: each such block would take a chunk out of the ring
// (max_pinned_bytes) for good, and with a ring of one chunk every later
// staged batch would fail. Freeing later on the same stream holds the block
// at least as long as freeing at once would have.
//
// Room for `reserved_blocks` kept blocks is taken when it is made; the engine
// holds at most two staging blocks at once (a pack's and a chunk's), so that
// many are kept without allocating whenever their frees keep being refused
// through several groups in a row. Past it a refused block is kept only if
// the host has memory for the list; else it stays with the staging allocator
// until the engine is destroyed.
//
// Thread-safety: the engine's thread only.
#pragma once

#include <cstddef>
#include <vector>

#include "shoal/alloc/caching_allocator.h"

namespace shoal::transfer {

class staging_frees {
 public:
  static constexpr std::size_t reserved_blocks = 16;

  /// Takes room for reserved_blocks (std::bad_alloc when there is none).
  staging_frees(alloc::caching_allocator& pinned, backend::stream_ref stream);
  staging_frees(const staging_frees&) = delete;
  staging_frees& operator=(const staging_frees&) = delete;

  /// Frees `block` (a staging block of `pinned`, its copies enqueued on
  /// `stream`), or keeps it to free again when the host refuses the memory.
  void free(void* block) noexcept;
  /// Frees again the blocks kept, as far as the host allows now. True while
  /// some remain.
  bool retry() noexcept;
  /// Blocks kept, their frees refused so far.
  [[nodiscard]] std::size_t kept() const noexcept { return refused_.size(); }

 private:
  // True when the allocator took the block (or refused it for good: not one
  // of its blocks); false when the host refused memory for its free.
  bool try_free(void* block) noexcept;

  alloc::caching_allocator& pinned_;
  const backend::stream_ref stream_;
  std::vector<void*> refused_;
};

}  // namespace shoal::transfer
