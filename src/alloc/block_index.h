// One pool's blocks by address (block_pool::by_address says which): open
// addressing with linear probing and backward-shift deletion. Not thread-safe: the pool's lock
// guards it, so the allocation path takes that one lock and no other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "alloc/block.h"

namespace shoal::alloc::detail {

class block_index {
 public:
  /// Makes room for one more insert, so that it cannot throw: called before
  /// a hand-out changes anything (std::bad_alloc leaves the block where it was).
  void reserve_one() {
    if (count_ == room_) grow();
  }
  /// Makes room for `n` more inserts (as reserve_one does for one).
  void reserve(std::size_t n) {
    while (room_ - count_ < n) grow();
  }
  void insert(block* b) {
    if (count_ == room_) grow();
    std::size_t i = home(b->address);
    while (slots_[i].address != 0) i = (i + 1) & mask_;
    slots_[i] = {b->address, b};
    ++count_;
  }
  /// Removes and returns the block at `address`, or nullptr.
  [[nodiscard]] block* take(std::uintptr_t address) noexcept {
    std::size_t i = home(address);
    while (slots_[i].address != address) {
      if (slots_[i].address == 0) return nullptr;
      i = (i + 1) & mask_;
    }
    block* found = slots_[i].value;
    if (slots_[(i + 1) & mask_].address == 0) [[likely]] {  // the end of its probe run: nothing to shift
      slots_[i] = {};
      --count_;
    } else {
      close_hole(i);
    }
    return found;
  }
  /// The block at `address`, or nullptr. Inline: one look-up per free.
  [[nodiscard]] block* find(std::uintptr_t address) const noexcept {
    for (std::size_t i = home(address);; i = (i + 1) & mask_) {
      if (slots_[i].address == address) [[likely]] return slots_[i].value;
      if (slots_[i].address == 0) return nullptr;
    }
  }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

 private:
  // Key 0 marks an empty slot (no block starts at address 0).
  struct slot {
    std::uintptr_t address = 0;
    block* value = nullptr;
  };
  [[nodiscard]] std::size_t home(std::uintptr_t address) const noexcept {
    return static_cast<std::size_t>(((address >> 9) * 0x9E3779B97F4A7C15ull) >> 32) & mask_;
  }
  void grow();
  /// Empties slot i, keeping every probe run unbroken.
  void close_hole(std::size_t i) noexcept;

  // At most half full, so probe runs stay short: room_ = slots / 2, and
  // mask_ = slots - 1 (slots a power of two).
  std::vector<slot> slots_ = std::vector<slot>(64);
  std::size_t mask_ = 63;
  std::size_t room_ = 32;
  std::size_t count_ = 0;
};

}  // namespace shoal::alloc::detail
