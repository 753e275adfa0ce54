// The allocated blocks of one pool, by address: open addressing with linear
// probing and backward-shift deletion. Not thread-safe: the pool's lock
// guards it, so the allocation path takes that one lock and no other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "alloc/block.h"

namespace shoal::alloc::detail {

class block_index {
 public:
  void insert(block* b);
  /// Removes and returns the block at `address`, or nullptr.
  [[nodiscard]] block* take(std::uintptr_t address) noexcept;
  /// The block at `address`, or nullptr.
  [[nodiscard]] block* find(std::uintptr_t address) const noexcept;
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

 private:
  // Key 0 marks an empty slot (no block starts at address 0).
  struct slot {
    std::uintptr_t address = 0;
    block* value = nullptr;
  };
  [[nodiscard]] std::size_t home(std::uintptr_t address) const noexcept {
    return static_cast<std::size_t>(((address >> 9) * 0x9E3779B97F4A7C15ull) >> 32) & (slots_.size() - 1);
  }
  void grow();

  std::vector<slot> slots_ = std::vector<slot>(64);
  std::size_t count_ = 0;
};

}  // namespace shoal::alloc::detail
