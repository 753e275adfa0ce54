// Validators for the daemon's numeric flags: the text as the operator wrote
// it, in decimal. CLI11 (2.1, Debian's) converts integers with strtoull /
// strtoll in base 0 — "010" is 8, "0x10" is 16 — and wraps a negative number
// into an unsigned one ("-18446744073709551615" is 1), and its checks then
// see only the converted value; strtod takes hex floats, "inf" and "nan". A
// validator runs on the text before the conversion, so these refuse such
// text with the flag named (exit 2), as the TOML file refuses leading zeros.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace shoal::tools {

/// Digits only, no leading zero but for 0 itself: for counts, milliseconds,
/// ports, uids and ids (none of the daemon's integer flags takes a negative).
inline CLI::Validator decimal_unsigned() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
        if (!digits || (text.size() > 1 && text[0] == '0')) {
          return "'" + text + "' is not a whole number in decimal (digits only, no leading zero)";
        }
        return {};
      },
      "DECIMAL");
}

/// A decimal number of seconds (digits, a point, an exponent): no hex float,
/// infinity or NaN.
inline CLI::Validator decimal_real() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text.empty() || text.find_first_not_of("0123456789.eE+-") != std::string::npos) {
          return "'" + text + "' is not a decimal number";
        }
        return {};
      },
      "DECIMAL");
}

}  // namespace shoal::tools
