// The element types of views (Storage.view, ArrayView) and lending layouts
// as Python spells them: shoal's names ('float32'), numpy's type codes
// ('f4', '<i8', '?') and other names ('single', 'intc'), numpy dtypes and
// scalar types (numpy.float32), and Python's float, int and bool, which
// numpy reads as float64, int64 and bool. numpy need not be loaded.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace shoal::python {

struct dtype_entry {
  std::string_view name;  ///< shoal's name, as shoal.view_dtypes() gives it
  std::uint8_t code;      ///< DLPack's type code
  std::uint8_t bits;
};

/// The element types a view can have, in shoal.view_dtypes()'s order.
std::span<const dtype_entry> view_dtype_entries();

/// What a dtype argument reads as.
struct dtype_reading {
  /// The type it names; nullptr when it names none of view_dtype_entries()
  /// (and when `swapped`, for a numpy dtype, whose name is the native one's).
  const dtype_entry* entry = nullptr;
  /// How an error names it: the spelling quoted ('f4'), or a numpy dtype
  /// of the other byte order as numpy writes it (>f4); empty for an object
  /// with no name (neither a str nor a `name` or `__name__` that is one).
  std::string shown;
  /// numpy's type for a code of a type views do not take ('D': complex128).
  std::string meaning;
  /// Of the other byte order than this machine's (one byte has none).
  bool swapped = false;
};

/// Reads `dtype` (a str or bytes, or an object with a str `name` or
/// `__name__`). Needs the GIL.
dtype_reading read_dtype(nanobind::handle dtype);

}  // namespace shoal::python
