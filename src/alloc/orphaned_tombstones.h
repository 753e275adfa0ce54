// Tombstones whose private pool was destroyed (forced_clear.cpp): addresses
// of blocks taken from their owners whose late frees are still owed after
// the memory left the allocator. When a private pool or a new segment of
// the allocator's covers one again, it becomes a tombstone there once more,
// so no newer block starts at the address; a late free that finds no pool
// forgets it and frees nothing.
//
// Thread-safety: every member may be called from any thread at once; its
// mutex is a leaf of the allocator's lock order (pool_directory.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

namespace shoal::alloc::detail {

class orphaned_tombstones {
 public:
  /// Makes room for `n` more, so that the next `n` add calls cannot fail.
  void reserve(std::size_t n);
  /// Remembers a tombstone at `address` (room reserved first).
  void add(std::uintptr_t address) noexcept;
  /// Forgets the one at `address`; false when there is none.
  bool forget(std::uintptr_t address);
  /// True when one is at `address`.
  [[nodiscard]] bool contains(std::uintptr_t address) const;
  /// Those in [low, high), in address order.
  [[nodiscard]] std::vector<std::uintptr_t> within(std::uintptr_t low, std::uintptr_t high) const;
  /// Forgets each of `addresses` there is.
  void forget_all(const std::vector<std::uintptr_t>& addresses) noexcept;
  /// Forgets those in [low, high) a multiple of `step` past `low`, at most
  /// into.size() of them (size it with count_within), and writes them to
  /// `into` in address order; returns how many.
  std::size_t take_within(std::uintptr_t low, std::uintptr_t high, std::size_t step,
                          std::span<std::uintptr_t> into) noexcept;
  /// How many of them lie in [low, high) a multiple of `step` past `low`.
  [[nodiscard]] std::size_t count_within(std::uintptr_t low, std::uintptr_t high, std::size_t step) const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::uintptr_t> addresses_;  // guarded by mutex_; unordered, each once
  // addresses_.size(), written under mutex_: a growth with none to look
  // for takes no lock.
  std::atomic<std::size_t> count_{0};
};

}  // namespace shoal::alloc::detail
