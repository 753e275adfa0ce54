// The one wire codec: little-endian fields written in order, and a reader
// that checks every read against the bytes it was given. Used by every
// layer that puts values on a socket (backend handles and event points, the
// sharing protocol's messages, protocol hellos).
//
// wire_reader throws protocol_error naming the message and field when the
// bytes run out or a field is out of range, so decoding code states each
// field once and never reads past the payload. Internal (not installed).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "shoal/core/error.h"

namespace shoal::detail {

// Fields are copied as they are in memory, which is little-endian order on
// every host shoal builds for.
static_assert(std::endian::native == std::endian::little, "the wire codec assumes a little-endian host");

class wire_writer {
 public:
  wire_writer() = default;
  /// Reserves `bytes` up front when the message's size is known.
  explicit wire_writer(std::size_t bytes) { bytes_.reserve(bytes); }

  template <class T>
    requires std::is_integral_v<T>
  wire_writer& put(T value) {
    const auto at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &value, sizeof(T));
    return *this;
  }
  /// A length-prefixed (u32) byte string.
  wire_writer& put_bytes(std::span<const std::byte> bytes) {
    put(static_cast<std::uint32_t>(bytes.size()));
    return put_fixed(bytes);
  }
  /// Bytes whose count both ends know (no length on the wire).
  wire_writer& put_fixed(std::span<const std::byte> bytes) {
    bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
    return *this;
  }
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::vector<std::byte> take() noexcept { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

class wire_reader {
 public:
  /// `message` names what is being read in errors ("storage").
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
    return get_fixed(field, length);
  }
  /// Exactly `count` bytes with no length on the wire.
  std::span<const std::byte> get_fixed(const char* field, std::size_t count) {
    need(count, field);
    auto out = bytes_.subspan(at_, count);
    at_ += count;
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

}  // namespace shoal::detail
