// Checks of the numbers the Python API takes, each refused by name: a
// negative size, id or uid would otherwise meet nanobind's own conversion
// and read "incompatible function arguments", naming no argument.
#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "bindings.h"
#include "shoal/core/error.h"

namespace shoal::python {

std::uint64_t whole_number_of(const python_int& value, const char* who, const char* what, std::uint64_t most,
                              bool positive) {
  // Read as an exact int, never through a subclass's own methods.
  PyObject* const object = value.value.ptr();
  int overflow = 0;  // -1: below int64, 1: above
  const long long number = PyLong_AsLongLongAndOverflow(object, &overflow);
  if (number == -1 && PyErr_Occurred() != nullptr) throw nb::python_error();
  const bool negative = overflow < 0 || (overflow == 0 && number < 0);
  std::optional<std::uint64_t> whole;  // the value, when from 0 to 2^64 - 1
  if (overflow == 0 && number >= 0) {
    whole = static_cast<std::uint64_t>(number);
  } else if (overflow > 0) {
    const unsigned long long big = PyLong_AsUnsignedLongLong(object);
    if (big == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr) {
      PyErr_Clear();  // past 2^64 - 1 as well
    } else {
      whole = big;
    }
  }
  const std::uint64_t least = positive ? 1 : 0;
  if (whole && *whole >= least && *whole <= most) return *whole;
  // The value in the message from C++, not from the object's __str__ (a
  // subclass's may raise, and Python prints no int of more than 4300 digits).
  std::string given;
  if (whole) {
    given = std::to_string(*whole);
  } else if (overflow == 0) {
    given = std::to_string(number);
  } else {
    given = negative ? "a negative number of more than 64 bits" : "a number of more than 64 bits";
  }
  if (negative || (whole && *whole < least)) {
    throw invalid_argument(std::string(who) + ": " + what + (positive ? " must be positive" : " must be >= 0") +
                           ", got " + given);
  }
  throw invalid_argument(std::string(who) + ": " + what + " must be at most " + std::to_string(most) + ", got " + given);
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
