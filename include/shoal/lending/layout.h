// A region's layout: named entries (offset, bytes, element type, shape),
// committed by the region's writer together with a content hash when it
// publishes the region, and read by every later borrower, so that processes
// agree on every address by name, never by allocation order.
//
//   region_layout layout;
//   layout.entries = {{"embed", 0, 64 * 32 * 2, dtype::float16, {64, 32}},
//                     {"head", 4096, 1024 * 4, dtype::float32, {1024}}};
//   ... fill the entries ...
//   layout.hash = hash_entries(device, region.data(), region.size(), layout);
//
// Well-formed (what layout_problem checks, and what the lender checks
// before it accepts a layout): 1..max_entries_for(region bytes) entries (at
// most max_layout_entries); names of 1 to
// max_entry_name_bytes printable ASCII bytes, each used once; a known
// dtype; a shape of at most max_entry_rank extents whose element count
// times the dtype's size is the entry's bytes (no overflow); an offset that
// is a multiple of the dtype's size; every entry inside the region; no two
// entries overlapping (entries of 0 bytes overlap nothing).
//
// The content hash is SHA-256 of the entries' bytes concatenated in
// increasing order of offset (bytes between entries are not covered). It
// is the writer's claim: the lender stores and hands it out without
// reading the memory; a reader checks it by hashing what it mapped
// (hash_entries) or asks for the region only under the hash it expects.
//
// Value types, not thread-safe to modify.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shoal/backend/device.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::lending {

inline constexpr std::size_t max_layout_entries = 4096;
/// A region's layout has at most one entry per region_bytes_per_layout_entry
/// of the region, and never fewer than layout_entries_floor allowed: the
/// lender keeps a published layout for the region's life (~250 bytes of its
/// heap for an entry of the longest name and shape), so what a borrower makes
/// it keep stays within ~1.5% of the memory it holds (4096 entries take a
/// region of 64 MiB; a region of one 2 MiB granule takes 128).
inline constexpr std::size_t layout_entries_floor = 128;
inline constexpr std::size_t region_bytes_per_layout_entry = std::size_t{16} << 10;
/// The most entries a layout of a region of `region_bytes` may have.
[[nodiscard]] constexpr std::size_t max_entries_for(std::size_t region_bytes) noexcept {
  const std::size_t by_size = region_bytes / region_bytes_per_layout_entry;
  return by_size < layout_entries_floor ? layout_entries_floor
         : by_size > max_layout_entries ? max_layout_entries
                                        : by_size;
}
inline constexpr std::size_t max_entry_name_bytes = 64;
inline constexpr std::size_t max_entry_rank = 8;

/// Element types (DLPack's).
enum class dtype : std::uint8_t {
  bool_ = 1,
  int8,
  uint8,
  int16,
  uint16,
  int32,
  uint32,
  int64,
  uint64,
  float16,
  bfloat16,
  float32,
  float64,
};

/// Bytes per element; 0 for a value that is no dtype.
[[nodiscard]] std::size_t itemsize(dtype type) noexcept;
/// "bool", "int8", ..., "float64"; "unknown" for a value that is no dtype.
[[nodiscard]] const char* to_string(dtype type) noexcept;
/// The dtype named `name` (to_string's names), or nothing.
[[nodiscard]] std::optional<dtype> dtype_named(std::string_view name) noexcept;

/// SHA-256 of the entries' bytes in offset order (see above).
using content_hash = std::array<std::byte, 32>;
/// 64 lowercase hex digits.
[[nodiscard]] std::string to_hex(const content_hash& hash);
/// The hash 64 hex digits spell; invalid_argument for anything else.
[[nodiscard]] content_hash hash_from_hex(std::string_view hex);

struct layout_entry {
  std::string name;
  std::uint64_t offset = 0;  ///< from the region's start
  std::uint64_t bytes = 0;
  dtype type = dtype::uint8;
  std::vector<std::uint64_t> shape;  ///< row-major (C order), no strides
};

struct region_layout {
  std::vector<layout_entry> entries;
  content_hash hash{};

  /// The entry named `name`; invalid_argument naming the entries there are
  /// when there is none.
  [[nodiscard]] const layout_entry& at(std::string_view name) const;
};

/// What makes `layout` malformed for a region of `region_bytes` (the first
/// problem found, naming the entry), or an empty string when it is
/// well-formed.
[[nodiscard]] std::string layout_problem(const region_layout& layout, std::size_t region_bytes);

/// The content hash of `layout`'s entries as they are now in the region
/// mapped at `base` on `device`: each entry's bytes are copied to the host
/// piece by piece (device memory on CUDA) and hashed in offset order. The
/// layout must be well-formed for the region (invalid_argument otherwise);
/// device errors as device::copy and synchronize throw them. Uses a stream
/// of its own, so it waits for no one else's work: the caller makes sure the
/// writes it means to cover are complete.
[[nodiscard]] content_hash hash_entries(backend::device& device, const void* base, std::size_t region_bytes,
                                        const region_layout& layout);

}  // namespace shoal::lending

#pragma GCC visibility pop
