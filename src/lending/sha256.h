// SHA-256 (FIPS 180-4), incremental: the content hash of a region's layout
// entries. Internal (not installed).
//
// Not thread-safe (a value type). Invariant: buffered_ < 64, and
// total_bytes_ counts every byte given to update() so far.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace shoal::lending::detail {

class sha256 {
 public:
  using digest = std::array<std::byte, 32>;

  sha256() noexcept;
  void update(std::span<const std::byte> bytes) noexcept;
  /// The digest of everything given so far; the object is spent after it.
  [[nodiscard]] digest finish() noexcept;

 private:
  void compress(const std::byte* block) noexcept;

  std::array<std::uint32_t, 8> state_{};
  std::array<std::byte, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
};

}  // namespace shoal::lending::detail
