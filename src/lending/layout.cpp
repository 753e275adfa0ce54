#include "shoal/lending/layout.h"

#include <algorithm>
#include <limits>
#include <set>
#include <span>

#include "lending/sha256.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"

namespace shoal::lending {

namespace {

struct dtype_row {
  dtype type;
  const char* name;
  std::size_t size;
};

constexpr std::array<dtype_row, 13> dtypes{{
    {dtype::bool_, "bool", 1},
    {dtype::int8, "int8", 1},
    {dtype::uint8, "uint8", 1},
    {dtype::int16, "int16", 2},
    {dtype::uint16, "uint16", 2},
    {dtype::int32, "int32", 4},
    {dtype::uint32, "uint32", 4},
    {dtype::int64, "int64", 8},
    {dtype::uint64, "uint64", 8},
    {dtype::float16, "float16", 2},
    {dtype::bfloat16, "bfloat16", 2},
    {dtype::float32, "float32", 4},
    {dtype::float64, "float64", 8},
}};

const dtype_row* row_of(dtype type) noexcept {
  const auto it = std::find_if(dtypes.begin(), dtypes.end(), [&](const dtype_row& r) { return r.type == type; });
  return it == dtypes.end() ? nullptr : &*it;
}

bool valid_name(std::string_view name) noexcept {
  return !name.empty() && name.size() <= max_entry_name_bytes &&
         std::all_of(name.begin(), name.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

// The entry's problem on its own (not against the others), or "".
std::string entry_problem(const layout_entry& e, std::size_t region_bytes) {
  const std::string which = "entry '" + e.name + "'";
  if (!valid_name(e.name)) {
    return "an entry's name must be 1 to " + std::to_string(max_entry_name_bytes) +
           " bytes of printable ASCII; got " + std::to_string(e.name.size()) + " bytes";
  }
  const std::size_t size = itemsize(e.type);
  if (size == 0) return which + " has dtype code " + std::to_string(static_cast<int>(e.type)) + ", which is no dtype";
  if (e.shape.size() > max_entry_rank) {
    return which + " has " + std::to_string(e.shape.size()) + " dimensions; at most " + std::to_string(max_entry_rank);
  }
  std::uint64_t elements = 1;
  for (const std::uint64_t extent : e.shape) {
    if (extent != 0 && elements > std::numeric_limits<std::uint64_t>::max() / extent) {
      return which + "'s shape has more elements than 64 bits count";
    }
    elements *= extent;
  }
  if (elements > std::numeric_limits<std::uint64_t>::max() / size || elements * size != e.bytes) {
    return which + " says " + std::to_string(e.bytes) + " bytes, but its shape holds " + std::to_string(elements) +
           " elements of " + to_string(e.type) + " (" + std::to_string(size) + " bytes each)";
  }
  if (e.offset % size != 0) {
    return which + "'s offset " + std::to_string(e.offset) + " is not a multiple of its item size " +
           std::to_string(size);
  }
  if (e.offset > region_bytes || e.bytes > region_bytes - e.offset) {
    return which + " spans bytes " + std::to_string(e.offset) + " + " + std::to_string(e.bytes) +
           ", past the region's " + std::to_string(region_bytes);
  }
  return "";
}

// The entries in increasing order of offset.
std::vector<const layout_entry*> by_offset(const region_layout& layout) {
  std::vector<const layout_entry*> order;
  order.reserve(layout.entries.size());
  for (const auto& e : layout.entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(),
                   [](const layout_entry* a, const layout_entry* b) { return a->offset < b->offset; });
  return order;
}

}  // namespace

std::size_t itemsize(dtype type) noexcept {
  const dtype_row* r = row_of(type);
  return r == nullptr ? 0 : r->size;
}

const char* to_string(dtype type) noexcept {
  const dtype_row* r = row_of(type);
  return r == nullptr ? "unknown" : r->name;
}

std::optional<dtype> dtype_named(std::string_view name) noexcept {
  const auto it = std::find_if(dtypes.begin(), dtypes.end(), [&](const dtype_row& r) { return name == r.name; });
  if (it == dtypes.end()) return std::nullopt;
  return it->type;
}

std::string to_hex(const content_hash& hash) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * hash.size());
  for (const std::byte b : hash) {
    out += digits[std::to_integer<unsigned>(b) >> 4];
    out += digits[std::to_integer<unsigned>(b) & 0xf];
  }
  return out;
}

content_hash hash_from_hex(std::string_view hex) {
  const auto value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  content_hash hash{};
  if (hex.size() != 2 * hash.size()) {
    throw invalid_argument("hash_from_hex: a content hash is 64 hex digits; got " + std::to_string(hex.size()) +
                           " characters");
  }
  for (std::size_t i = 0; i < hash.size(); ++i) {
    const int high = value(hex[2 * i]);
    const int low = value(hex[2 * i + 1]);
    if (high < 0 || low < 0) {
      throw invalid_argument("hash_from_hex: '" + std::string(hex.substr(2 * i, 2)) + "' at " +
                             std::to_string(2 * i) + " is not two hex digits");
    }
    hash[i] = static_cast<std::byte>(high * 16 + low);
  }
  return hash;
}

const layout_entry& region_layout::at(std::string_view name) const {
  for (const auto& e : entries) {
    if (e.name == name) return e;
  }
  std::string names;
  for (std::size_t i = 0; i < entries.size() && i < 8; ++i) names += (i == 0 ? "'" : ", '") + entries[i].name + "'";
  if (entries.size() > 8) names += ", ...";
  throw invalid_argument("region_layout: no entry is named '" + std::string(name) + "'; the layout has " +
                         std::to_string(entries.size()) + " entries" + (names.empty() ? "" : ": " + names));
}

std::string layout_problem(const region_layout& layout, std::size_t region_bytes) {
  if (layout.entries.empty() || layout.entries.size() > max_layout_entries) {
    return "a layout has 1 to " + std::to_string(max_layout_entries) + " entries; got " +
           std::to_string(layout.entries.size());
  }
  if (const std::size_t most = max_entries_for(region_bytes); layout.entries.size() > most) {
    return "a region of " + std::to_string(region_bytes) + " bytes has a layout of at most " + std::to_string(most) +
           " entries (one per " + std::to_string(region_bytes_per_layout_entry) + " bytes, at least " +
           std::to_string(layout_entries_floor) + "); got " + std::to_string(layout.entries.size()) +
           ": borrow a larger region, or pack small tensors into one entry";
  }
  std::set<std::string_view> names;
  for (const auto& e : layout.entries) {
    if (auto problem = entry_problem(e, region_bytes); !problem.empty()) return problem;
    if (!names.insert(e.name).second) return "two entries are named '" + e.name + "'";
  }
  const auto order = by_offset(layout);
  const layout_entry* reach = nullptr;  // of the entries so far, the one that ends last
  for (const layout_entry* e : order) {
    if (e->bytes == 0) continue;
    if (reach != nullptr && e->offset < reach->offset + reach->bytes) {
      return "entries '" + reach->name + "' (bytes " + std::to_string(reach->offset) + " + " +
             std::to_string(reach->bytes) + ") and '" + e->name + "' (from byte " + std::to_string(e->offset) +
             ") overlap";
    }
    if (reach == nullptr || e->offset + e->bytes > reach->offset + reach->bytes) reach = e;
  }
  return "";
}

content_hash hash_entries(backend::device& device, const void* base, std::size_t region_bytes,
                          const region_layout& layout) {
  if (auto problem = layout_problem(layout, region_bytes); !problem.empty()) {
    throw invalid_argument("hash_entries: the layout is malformed: " + problem);
  }
  constexpr std::size_t piece = std::size_t{4} << 20;
  backend::stream s(device);
  std::vector<std::byte> staging;
  detail::sha256 hash;
  for (const layout_entry* e : by_offset(layout)) {
    for (std::uint64_t done = 0; done < e->bytes;) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(piece, e->bytes - done));
      staging.resize(n);
      device.copy(s, staging.data(), static_cast<const std::byte*>(base) + e->offset + done, n);
      s.synchronize();
      hash.update(std::span(staging.data(), n));
      done += n;
    }
  }
  return hash.finish();
}

}  // namespace shoal::lending
