// Text another process sent, made fit for messages: bytes outside printable
// ASCII are written \xNN (and the backslash itself \x5c), so that a message
// that quotes a peer is not cut short at a NUL, stays UTF-8 for Python, and
// carries no newline or terminal escape into a log. Shared by every layer's
// source files (not installed).
#pragma once

#include <string>
#include <string_view>

namespace shoal::detail {

inline std::string printable(std::string_view bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size());
  for (const char c : bytes) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f && byte != '\\') {
      out += c;
    } else {
      out += {'\\', 'x', digits[byte >> 4], digits[byte & 0xf]};
    }
  }
  return out;
}

}  // namespace shoal::detail
