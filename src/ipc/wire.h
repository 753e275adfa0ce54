// Little-endian field writing and bounds-checked reading for messages.
//
// wire_reader throws protocol_error naming the message and field when the
// bytes run out or a field is out of range, so decoding code states each
// field once and never reads past the payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "shoal/error.h"

namespace shoal::ipc::detail {

class wire_writer {
 public:
  template <class T>
    requires std::is_integral_v<T>
  wire_writer& put(T value) {
    const auto at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &value, sizeof(T));  // hosts are little-endian (x86-64, aarch64)
    return *this;
  }
  wire_writer& put_bytes(std::span<const std::byte> bytes) {
    put(static_cast<std::uint32_t>(bytes.size()));
    bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
    return *this;
  }
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

class wire_reader {
 public:
  wire_reader(std::span<const std::byte> bytes, const char* message) : bytes_(bytes), message_(message) {}

  template <class T>
    requires std::is_integral_v<T>
  T get(const char* field) {
    need(sizeof(T), field);
    T value;
    std::memcpy(&value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  /// A length-prefixed byte string of at most `limit` bytes.
  std::span<const std::byte> get_bytes(const char* field, std::size_t limit) {
    const auto length = get<std::uint32_t>(field);
    if (length > limit) {
      fail(field, std::to_string(length) + " bytes is over the limit of " + std::to_string(limit));
    }
    need(length, field);
    auto out = bytes_.subspan(at_, length);
    at_ += length;
    return out;
  }
  /// Every byte must have been read: trailing bytes are malformed too.
  void finish() const {
    if (at_ != bytes_.size()) fail("end", std::to_string(bytes_.size() - at_) + " unexpected trailing bytes");
  }
  [[noreturn]] void fail(const char* field, const std::string& why) const {
    throw protocol_error(std::string(message_) + " message: field '" + field + "': " + why);
  }

 private:
  void need(std::size_t bytes, const char* field) const {
    if (bytes_.size() - at_ < bytes) fail(field, "the message ends early");
  }
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
  const char* message_;
};

}  // namespace shoal::ipc::detail
