// Addresses as text for error messages: "0x7f3a00000000". Shared by every
// layer's source files (not installed).
#pragma once

#include <charconv>
#include <cstdint>
#include <iterator>
#include <string>

namespace shoal::detail {

inline std::string hex(std::uintptr_t value) {
  char digits[2 + 2 * sizeof value] = {'0', 'x'};
  const auto end = std::to_chars(digits + 2, std::end(digits), value, 16).ptr;
  return std::string(digits, end);
}

inline std::string hex(const void* pointer) { return hex(reinterpret_cast<std::uintptr_t>(pointer)); }

}  // namespace shoal::detail
