// A fuzz input's bytes read front to back as fields, zeros once they run
// out: how the fuzz targets' programs (hostile_program.h,
// lending_program.h) take their operations from an input.
//
// Not thread-safe: one reader per input, used by one thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace shoal::fuzz {

// The input's bytes, read front to back; zeros once they run out.
class program_reader {
 public:
  explicit program_reader(std::span<const std::uint8_t> input) : input_(input) {}

  [[nodiscard]] bool done() const noexcept { return at_ >= input_.size(); }
  std::uint8_t u8() { return done() ? 0 : input_[at_++]; }
  std::uint16_t u16() { return static_cast<std::uint16_t>(u8() | (u8() << 8)); }
  std::uint32_t u32() {
    const std::uint32_t low = u16();
    return low | (std::uint32_t{u16()} << 16);
  }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{u8()} << (8 * i);
    return v;
  }
  std::vector<std::byte> bytes(std::size_t n) {
    n = std::min(n, input_.size() - std::min(at_, input_.size()));
    std::vector<std::byte> out(n);
    if (n > 0) std::memcpy(out.data(), input_.data() + at_, n);
    at_ += n;
    return out;
  }

 private:
  std::span<const std::uint8_t> input_;
  std::size_t at_ = 0;
};

}  // namespace shoal::fuzz
