// Which block an allocated pointer belongs to: a hash table split into
// shards with a lock each, so threads freeing different pointers rarely
// meet. Holds exactly the allocated (not yet freed) blocks, so a pointer
// found here may be freed, and removing it is what claims the free: two
// racing frees of one pointer see one success and one "not allocated".
//
// Thread-safety: all members may be called concurrently.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "alloc/block.h"
#include "alloc/spin_lock.h"

namespace shoal::alloc::detail {

class block_index {
 public:
  void insert(block* b);
  /// Removes and returns the block at `address`, or nullptr.
  [[nodiscard]] block* take(std::uintptr_t address) noexcept;
  /// The block at `address`, or nullptr. The caller must know it stays
  /// allocated meanwhile.
  [[nodiscard]] block* find(std::uintptr_t address) const noexcept;

 private:
  // Open addressing with linear probing and backward-shift deletion; key 0
  // marks an empty slot (no block starts at address 0).
  struct slot {
    std::uintptr_t address = 0;
    block* value = nullptr;
  };
  struct alignas(64) shard {
    mutable spin_lock lock;
    std::vector<slot> slots = std::vector<slot>(64);
    std::size_t count = 0;
  };
  static constexpr std::size_t shard_count = 64;

  [[nodiscard]] static std::uint64_t hash(std::uintptr_t address) noexcept {
    return (static_cast<std::uint64_t>(address) >> 9) * 0x9E3779B97F4A7C15ull;
  }
  [[nodiscard]] shard& shard_of(std::uint64_t h) const noexcept { return shards_[h >> 58]; }
  static void grow(shard& s);

  mutable std::array<shard, shard_count> shards_;
};

}  // namespace shoal::alloc::detail
