// Checks of the numbers the Python API takes, each refused by name: a
// negative size, id or uid would otherwise meet nanobind's own conversion
// and read "incompatible function arguments", naming no argument.
// Every file that casts to std::string includes its caster: without it the
// cast compiles to the generic one, and the linker may keep that copy for
// every file (each cast to std::string would then raise std::bad_cast).
#include <nanobind/stl/string.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "bindings.h"
#include "shoal/core/error.h"

namespace shoal::python {

namespace {

// An int read exactly, never through a subclass's own methods.
struct int_read {
  long long number = 0;
  int overflow = 0;                    // -1: below int64, 1: above
  std::optional<std::uint64_t> whole;  // the value, when from 0 to 2^64 - 1

  [[nodiscard]] bool negative() const noexcept { return overflow < 0 || (overflow == 0 && number < 0); }
  // The value for a message, from C++, not from the object's __str__ (a
  // subclass's may raise, and Python prints no int of more than 4300 digits).
  [[nodiscard]] std::string text() const {
    if (whole) return std::to_string(*whole);
    if (overflow == 0) return std::to_string(number);
    return negative() ? "a negative number of more than 64 bits" : "a number of more than 64 bits";
  }
};

int_read read_int(const python_int& value) {
  PyObject* const object = value.value.ptr();
  int_read read;
  read.number = PyLong_AsLongLongAndOverflow(object, &read.overflow);
  if (read.number == -1 && PyErr_Occurred() != nullptr) throw nb::python_error();
  if (read.overflow == 0 && read.number >= 0) {
    read.whole = static_cast<std::uint64_t>(read.number);
  } else if (read.overflow > 0) {
    const unsigned long long big = PyLong_AsUnsignedLongLong(object);
    if (big == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr) {
      PyErr_Clear();  // past 2^64 - 1 as well
    } else {
      read.whole = big;
    }
  }
  return read;
}

// An int to Python, but True as a size, an offset or a byte is a slip.
void refuse_bool(const python_int& value, const char* who, const char* what) {
  if (PyBool_Check(value.value.ptr()) != 0) {
    throw nb::type_error((std::string(who) + ": " + what + " must be an int, not a bool").c_str());
  }
}

}  // namespace

std::uint64_t whole_number_of(const python_int& value, const char* who, const char* what, std::uint64_t most,
                              bool positive) {
  refuse_bool(value, who, what);
  const int_read read = read_int(value);
  const std::uint64_t least = positive ? 1 : 0;
  if (read.whole && *read.whole >= least && *read.whole <= most) return *read.whole;
  if (read.negative() || (read.whole && *read.whole < least)) {
    throw invalid_argument(std::string(who) + ": " + what + (positive ? " must be positive" : " must be >= 0") +
                           ", got " + read.text());
  }
  throw invalid_argument(std::string(who) + ": " + what + " must be at most " + std::to_string(most) + ", got " +
                         read.text());
}

std::optional<python_int> index_of(nb::handle value) {
  if (PyBool_Check(value.ptr()) != 0 || PyIndex_Check(value.ptr()) == 0) return std::nullopt;
  PyObject* const whole = PyNumber_Index(value.ptr());
  if (whole == nullptr) {  // its __index__ refused (an array of more than one value)
    PyErr_Clear();
    return std::nullopt;
  }
  return python_int{nb::steal(whole)};
}

char numpy_scalar_kind(nb::handle value) {
  const nb::object ndim = nb::getattr(value, "ndim", nb::none());
  if (!nb::isinstance<nb::int_>(ndim) || !ndim.equal(nb::int_(0))) return 0;
  const nb::object kind = nb::getattr(nb::getattr(value, "dtype", nb::none()), "kind", nb::none());
  if (!nb::isinstance<nb::str>(kind)) return 0;
  const auto text = nb::cast<std::string>(kind);
  return text.size() == 1 ? text[0] : 0;
}

std::int64_t signed_number_of(const python_int& value, const char* who, const char* what) {
  refuse_bool(value, who, what);
  const int_read read = read_int(value);
  if (read.overflow == 0) return read.number;
  throw invalid_argument(std::string(who) + ": " + what + " must lie from -2^63 to 2^63 - 1, got " + read.text());
}

channel::access_policy policy_of(const std::vector<python_int>& allowed_uids, const char* who) {
  // (uid_t)-1 means "no uid" to the kernel: no process runs as it.
  constexpr std::uint64_t largest_uid = std::numeric_limits<std::uint32_t>::max() - 1;
  channel::access_policy policy;
  for (const auto& uid : allowed_uids) {
    policy.allowed_uids.push_back(static_cast<uid_t>(whole_number_of(uid, who, "allowed_uids", largest_uid)));
  }
  return policy;
}

std::optional<std::chrono::milliseconds> deadline_of(std::optional<double> seconds, const char* who,
                                                     const char* what) {
  if (!seconds) return std::nullopt;
  if (!(*seconds >= 0) || !std::isfinite(*seconds)) {
    throw invalid_argument(std::string(who) + ": " + what + " must be a finite number of seconds >= 0");
  }
  constexpr double century = 100.0 * 365.25 * 24 * 3600;
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(std::min(*seconds, century) * 1000.0)));
}

}  // namespace shoal::python
