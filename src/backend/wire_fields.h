// Fixed-size wire forms of the backend's shareable values: fields are
// written in host byte order (both ends run on one machine) with no padding.
// Internal to src/backend.
#pragma once

#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

namespace shoal::backend::detail {

/// Appends the bytes of `value` to `out`.
template <class T>
void put_field(std::vector<std::byte>& out, const T& value) {
  static_assert(std::is_trivially_copyable_v<T>);
  const auto* p = reinterpret_cast<const std::byte*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

/// Reads a T from the front of `in` and drops its bytes. The caller has
/// checked that `in` holds the whole message.
template <class T>
T take_field(std::span<const std::byte>& in) {
  static_assert(std::is_trivially_copyable_v<T>);
  T value;
  std::memcpy(&value, in.data(), sizeof(T));
  in = in.subspan(sizeof(T));
  return value;
}

}  // namespace shoal::backend::detail
