// The free blocks of one pool, binned by size for best-fit search in O(1)
// set/unset and a bitmap scan.
//
// Bins: below 1 MiB one bin per 512-byte size (exact, so any block of the
// first non-empty bin at or above the request is a best fit); above, eight
// bins per power of two, scanned for the smallest block that fits.
// Not thread-safe: the owning pool's lock guards it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "alloc/block.h"

namespace shoal::alloc::detail {

class free_bins {
 public:
  void insert(block* b) noexcept;
  void remove(block* b) noexcept;
  /// The smallest free block of at least `bytes`, or nullptr.
  [[nodiscard]] block* best_fit(std::size_t bytes) const noexcept;
  /// The largest free block's size (for out-of-memory reports).
  [[nodiscard]] std::size_t largest() const noexcept;
  [[nodiscard]] bool empty() const noexcept;

  // ---- for the invariant checker
  /// Calls fn(b) for every block in the bins.
  template <class Fn>
  void for_each(Fn&& fn) const {
    for (const block* head : heads_) {
      for (const block* b = head; b != nullptr; b = b->bin_next) fn(b);
    }
  }
  /// What is wrong with the bins' own structure (a block in the wrong bin,
  /// a broken back link, a bitmap bit that disagrees with its bin), or ""
  /// when nothing is.
  [[nodiscard]] std::string inconsistency() const;

 private:
  static constexpr std::size_t exact_bins = 2048;  // 512-byte steps below 1 MiB
  static constexpr std::size_t sub_bins = 8;
  // Sizes are below 2^64, so size / 512 has at most 55 bits: logs 11..54.
  static constexpr std::size_t bins = exact_bins + (55 - 11) * sub_bins;
  static constexpr std::size_t words = (bins + 63) / 64;

  [[nodiscard]] static std::size_t bin_of(std::size_t size) noexcept;
  /// The least size bin_of maps to `bin`: bin_of(smallest_size_of(b)) == b.
  [[nodiscard]] static std::size_t smallest_size_of(std::size_t bin) noexcept;
  [[nodiscard]] std::size_t next_nonempty(std::size_t from) const noexcept;  // bins if none

  std::array<block*, bins> heads_{};
  std::array<std::uint64_t, words> nonempty_{};
  std::uint64_t nonempty_words_ = 0;  // bit w set iff nonempty_[w] != 0
  static_assert(words <= 64, "one summary word covers the bitmap");
};

}  // namespace shoal::alloc::detail
