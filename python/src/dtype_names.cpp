// Reading the spellings of an element type (dtype_names.h).
#include "dtype_names.h"

#include <nanobind/stl/string.h>

#include <array>
#include <bit>
#include <string>
#include <string_view>

#include "dlpack_abi.h"

namespace nb = nanobind;

namespace shoal::python {

namespace {

constexpr std::array<dtype_entry, 14> dtypes = {{
    {"bool", dlpack::kDLBool, 8},
    {"int8", dlpack::kDLInt, 8},
    {"int16", dlpack::kDLInt, 16},
    {"int32", dlpack::kDLInt, 32},
    {"int64", dlpack::kDLInt, 64},
    {"uint8", dlpack::kDLUInt, 8},
    {"uint16", dlpack::kDLUInt, 16},
    {"uint32", dlpack::kDLUInt, 32},
    {"uint64", dlpack::kDLUInt, 64},
    {"float16", dlpack::kDLFloat, 16},
    {"bfloat16", dlpack::kDLBfloat, 16},
    {"float32", dlpack::kDLFloat, 32},
    {"float64", dlpack::kDLFloat, 64},
    {"complex64", dlpack::kDLComplex, 64},
}};

const dtype_entry* entry_named(std::string_view name) {
  for (const auto& entry : dtypes) {
    if (entry.name == name) return &entry;
  }
  return nullptr;
}

const dtype_entry* entry_of(std::uint8_t code, std::size_t bytes) {
  for (const auto& entry : dtypes) {
    if (entry.code == code && entry.bits == bytes * 8) return &entry;
  }
  return nullptr;
}

/// numpy's names of the supported types besides their own (numpy 2's
/// sctypeDict; numpy 1's float_, int0, uint0, bool8, singlecomplex too):
/// the C types by their sizes here, as numpy sizes them.
const dtype_entry* entry_of_numpy_name(std::string_view name) {
  struct alias {
    std::string_view name;
    std::uint8_t code;
    std::size_t bytes;
  };
  static const alias aliases[] = {
      {"bool_", dlpack::kDLBool, 1},          {"bool8", dlpack::kDLBool, 1},
      {"byte", dlpack::kDLInt, 1},            {"ubyte", dlpack::kDLUInt, 1},
      {"short", dlpack::kDLInt, sizeof(short)}, {"ushort", dlpack::kDLUInt, sizeof(short)},
      {"intc", dlpack::kDLInt, sizeof(int)},  {"uintc", dlpack::kDLUInt, sizeof(int)},
      {"long", dlpack::kDLInt, sizeof(long)}, {"ulong", dlpack::kDLUInt, sizeof(long)},
      {"longlong", dlpack::kDLInt, sizeof(long long)}, {"ulonglong", dlpack::kDLUInt, sizeof(long long)},
      {"intp", dlpack::kDLInt, sizeof(void*)}, {"uintp", dlpack::kDLUInt, sizeof(void*)},
      {"int_", dlpack::kDLInt, sizeof(void*)}, {"int", dlpack::kDLInt, sizeof(void*)},
      {"uint", dlpack::kDLUInt, sizeof(void*)}, {"int0", dlpack::kDLInt, sizeof(void*)},
      {"uint0", dlpack::kDLUInt, sizeof(void*)}, {"half", dlpack::kDLFloat, 2},
      {"single", dlpack::kDLFloat, 4},        {"double", dlpack::kDLFloat, 8},
      {"float", dlpack::kDLFloat, 8},         {"float_", dlpack::kDLFloat, 8},
      {"csingle", dlpack::kDLComplex, 8},     {"singlecomplex", dlpack::kDLComplex, 8},
  };
  for (const auto& a : aliases) {
    if (a.name == name) return entry_of(a.code, a.bytes);
  }
  return nullptr;
}

/// A numpy type code ('f4', '<i8', '|u1', '?', 'f', '=d'): a byte order
/// ('<', '>', '=', '|') then a one-letter code or a kind and a size in
/// bytes. Sets `swapped` for the other byte order than this machine's (one
/// byte has none). nullptr for anything else, and for a code of a type
/// views do not take; `meaning` then names the type numpy reads in it.
const dtype_entry* entry_of_type_code(std::string_view text, bool& swapped, std::string& meaning) {
  char order = '=';
  if (!text.empty() && std::string_view("<>=|").find(text.front()) != std::string_view::npos) {
    order = text.front();
    text.remove_prefix(1);
  }
  if (text.empty()) return nullptr;
  std::uint8_t code = 0;
  std::size_t bytes = 0;
  if (text.size() == 1) {
    switch (text.front()) {
      case '?': code = dlpack::kDLBool, bytes = 1; break;
      case 'b': code = dlpack::kDLInt, bytes = 1; break;
      case 'B': code = dlpack::kDLUInt, bytes = 1; break;
      case 'h': code = dlpack::kDLInt, bytes = sizeof(short); break;
      case 'H': code = dlpack::kDLUInt, bytes = sizeof(short); break;
      case 'i': code = dlpack::kDLInt, bytes = sizeof(int); break;
      case 'I': code = dlpack::kDLUInt, bytes = sizeof(int); break;
      case 'l': code = dlpack::kDLInt, bytes = sizeof(long); break;
      case 'L': code = dlpack::kDLUInt, bytes = sizeof(long); break;
      case 'q': code = dlpack::kDLInt, bytes = sizeof(long long); break;
      case 'Q': code = dlpack::kDLUInt, bytes = sizeof(long long); break;
      case 'n': case 'p': code = dlpack::kDLInt, bytes = sizeof(void*); break;
      case 'N': case 'P': code = dlpack::kDLUInt, bytes = sizeof(void*); break;
      case 'e': code = dlpack::kDLFloat, bytes = 2; break;
      case 'f': code = dlpack::kDLFloat, bytes = 4; break;
      case 'd': code = dlpack::kDLFloat, bytes = 8; break;
      case 'F': code = dlpack::kDLComplex, bytes = 8; break;
      case 'D': meaning = "complex128"; return nullptr;
      case 'g': meaning = "longdouble"; return nullptr;
      case 'G': meaning = "clongdouble"; return nullptr;
      default: return nullptr;
    }
  } else {
    const std::string_view digits = text.substr(1);
    if (digits.find_first_not_of("0123456789") != std::string_view::npos || digits.size() > 2 || digits[0] == '0') {
      return nullptr;
    }
    bytes = std::stoul(std::string(digits));
    switch (text.front()) {
      case 'b':
        if (bytes != 1) return nullptr;
        code = dlpack::kDLBool;
        break;
      case 'i': code = dlpack::kDLInt; break;
      case 'u': code = dlpack::kDLUInt; break;
      case 'f':
        code = dlpack::kDLFloat;
        if (bytes == 16) meaning = "float128";
        break;
      case 'c':
        code = dlpack::kDLComplex;
        if (bytes == 16 || bytes == 32) meaning = "complex" + std::to_string(bytes * 8);
        break;
      default: return nullptr;
    }
  }
  const dtype_entry* entry = entry_of(code, bytes);
  if (entry != nullptr) {
    const char other = std::endian::native == std::endian::little ? '>' : '<';
    swapped = order == other && bytes > 1;
  }
  return entry;
}

/// `name` as an error message shows it: quoted, at most 64 characters (a
/// long string is not echoed whole), other than printable ASCII escaped (a
/// NUL would end the message early).
std::string quoted(std::string_view name) {
  constexpr std::size_t most = 64;
  std::string out = "'";
  for (const char c : name.substr(0, most)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7F && c != '\\') {
      out += c;
    } else {
      static constexpr char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[byte >> 4];
      out += hex[byte & 0xF];
    }
  }
  out += name.size() > most ? "'..." : "'";
  return out;
}

}  // namespace

std::span<const dtype_entry> view_dtype_entries() { return dtypes; }

dtype_reading read_dtype(nb::handle dtype) {
  dtype_reading out;
  std::string name;
  if (nb::isinstance<nb::str>(dtype)) {
    // A str that is no UTF-8 (a lone surrogate) names no dtype: refused as
    // one, not as a failed conversion.
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(dtype.ptr(), &size);
    if (utf8 == nullptr) {
      PyErr_Clear();
      out.shown = "a str that is not UTF-8";
      return out;
    }
    name.assign(utf8, static_cast<std::size_t>(size));
  } else if (nb::isinstance<nb::bytes>(dtype)) {
    const auto bytes = nb::borrow<nb::bytes>(dtype);  // numpy takes b'f4' too
    name.assign(bytes.c_str(), bytes.size());
  } else {
    if (nb::hasattr(dtype, "isnative") && !nb::cast<bool>(nb::bool_(dtype.attr("isnative")))) {
      out.shown = nb::cast<std::string>(nb::str(dtype));
      out.swapped = true;
      return out;
    }
    for (const char* attribute : {"name", "__name__"}) {
      if (!nb::hasattr(dtype, attribute)) continue;
      nb::object given = dtype.attr(attribute);
      if (nb::isinstance<nb::str>(given)) {
        name = nb::cast<std::string>(given);
        break;
      }
    }
    if (name.empty()) return out;
  }
  out.shown = quoted(name);
  out.entry = entry_named(name);
  if (out.entry == nullptr) out.entry = entry_of_numpy_name(name);
  if (out.entry == nullptr) out.entry = entry_of_type_code(name, out.swapped, out.meaning);
  if (out.swapped) out.entry = nullptr;
  return out;
}

}  // namespace shoal::python
