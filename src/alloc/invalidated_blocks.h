// Addresses of blocks a forced clear took from their owners (a private
// pool cleared or released with blocks still allocated). Their owners may
// still free them: each such free is absorbed here, once per invalidation,
// before the allocator looks for a live block at that address — so a stale
// free never frees a newer block that happens to start at the same address
// (when one does and its owner frees first, that free is the one absorbed
// and the block goes with the stale one's free: one free per hand-out
// either way, never two).
//
// Thread-safety: every member may be called from any thread at once;
// may_hold() is one relaxed load for the free path.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace shoal::alloc::detail {

class invalidated_blocks {
 public:
  void add(std::uintptr_t address);
  /// Whether any invalidated address waits for its free.
  [[nodiscard]] bool may_hold() const noexcept { return count_.load(std::memory_order_relaxed) > 0; }
  /// Absorbs one free of `address` if it was invalidated; false otherwise.
  bool absorb_free(std::uintptr_t address);
  /// Invalidated addresses whose owners have not freed them yet.
  [[nodiscard]] std::size_t outstanding() const noexcept { return count_.load(std::memory_order_relaxed); }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<std::uintptr_t, std::size_t> frees_owed_;  // address -> invalidations not yet freed
  std::atomic<std::size_t> count_{0};
};

}  // namespace shoal::alloc::detail
