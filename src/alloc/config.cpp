#include "shoal/alloc/config.h"

#include <bit>
#include <charconv>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "shoal/core/error.h"

namespace shoal::alloc {

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

[[noreturn]] void bad_value(std::string_view key, std::string_view value, std::string_view expected) {
  throw invalid_argument("SHOAL_ALLOC_CONF: " + std::string(key) + ":" + std::string(value) + " is not valid; expected " +
                         std::string(expected));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::uint64_t parse_unsigned(std::string_view key, std::string_view value) {
  std::uint64_t out = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), out);
  if (ec != std::errc{} || end != value.data() + value.size()) bad_value(key, value, "a non-negative integer");
  return out;
}

std::size_t parse_mib(std::string_view key, std::string_view value) {
  const std::uint64_t n = parse_unsigned(key, value);
  if (n == 0 || n > (~std::uint64_t{0} >> 20)) bad_value(key, value, "a positive number of MiB");
  return static_cast<std::size_t>(n) * mib;
}

bool parse_bool(std::string_view key, std::string_view value) {
  if (value == "true" || value == "True" || value == "1") return true;
  if (value == "false" || value == "False" || value == "0") return false;
  bad_value(key, value, "true or false");
}

std::uint32_t parse_divisions(std::string_view key, std::string_view value) {
  const std::uint64_t n = parse_unsigned(key, value);
  if (n != 0 && (n > 64 || !std::has_single_bit(n))) bad_value(key, value, "a power of two from 1 to 64 (or 0)");
  return static_cast<std::uint32_t>(n);
}

// "N" applies to every size; "[a:N,b:M,>:K]" applies N to the power-of-two
// intervals that start below a MiB, M to those below b MiB, K to the rest.
void parse_roundup(std::string_view value, std::array<std::uint32_t, 64>& divisions) {
  constexpr std::string_view key = "roundup_power2_divisions";
  if (value.empty() || value.front() != '[') {
    divisions.fill(parse_divisions(key, value));
    return;
  }
  if (value.back() != ']') bad_value(key, value, "N or [size_mb:N,...,>:N]");
  std::string_view items = value.substr(1, value.size() - 2);
  std::size_t next_interval = 0;  // log2 of the first interval not yet set
  while (!items.empty()) {
    const std::size_t comma = items.find(';') != std::string_view::npos ? items.find(';') : items.find('|');
    const std::string_view item = trim(items.substr(0, comma));
    items = comma == std::string_view::npos ? std::string_view{} : items.substr(comma + 1);
    const std::size_t colon = item.find(':');
    if (colon == std::string_view::npos) bad_value(key, item, "size_mb:N");
    const std::string_view bound = trim(item.substr(0, colon));
    const std::uint32_t n = parse_divisions(key, trim(item.substr(colon + 1)));
    std::size_t end = 64;
    if (bound != ">") {
      const std::size_t bytes = parse_mib(key, bound);
      if (!std::has_single_bit(bytes)) bad_value(key, bound, "a power-of-two size in MiB");
      end = static_cast<std::size_t>(std::countr_zero(bytes));
    }
    if (end <= next_interval) bad_value(key, bound, "sizes in increasing order");
    for (std::size_t i = next_interval; i < end; ++i) divisions[i] = n;
    next_interval = end;
  }
}

}  // namespace

allocator_config allocator_config::parse(std::string_view text) {
  allocator_config c;
  // Items are separated by commas, except inside [...] lists, whose items
  // are re-separated by ';' here so one split serves both levels.
  std::string normalized(text);
  int depth = 0;
  for (char& ch : normalized) {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (ch == ',' && depth > 0) ch = ';';
  }
  std::string_view rest = normalized;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    if (item.empty()) continue;
    const std::size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      throw invalid_argument("SHOAL_ALLOC_CONF: '" + std::string(item) + "' has no ':'; write key:value");
    }
    const std::string_view key = trim(item.substr(0, colon));
    const std::string_view value = trim(item.substr(colon + 1));
    if (key == "max_split_size_mb") {
      c.max_split_size = parse_mib(key, value);
    } else if (key == "max_non_split_rounding_mb") {
      c.max_non_split_rounding = parse_mib(key, value);
    } else if (key == "roundup_power2_divisions") {
      parse_roundup(value, c.roundup_power2_divisions);
    } else if (key == "expandable_segments") {
      c.expandable_segments = parse_bool(key, value);
    } else if (key == "debug") {
      c.debug = parse_bool(key, value);
    } else if (key == "cross_stream_safety") {
      c.cross_stream_safety = parse_bool(key, value);
    } else if (key == "release_idle_before_grow") {
      c.release_idle_before_grow = parse_bool(key, value);
    } else if (key == "memory_limit_mb") {
      c.memory_limit = parse_mib(key, value);
    } else if (key == "memory_fraction") {
      char* end = nullptr;
      const std::string v(value);
      const double f = std::strtod(v.c_str(), &end);
      if (v.empty() || end != v.c_str() + v.size() || !(f > 0.0 && f <= 1.0)) bad_value(key, value, "a fraction in (0, 1]");
      c.memory_fraction = f;
    } else if (key == "trace_entries") {
      c.trace_entries = static_cast<std::size_t>(parse_unsigned(key, value));
    } else if (key == "memory") {
      if (value == "device") {
        c.memory = allocator_memory::device;
      } else if (value == "pinned_host") {
        c.memory = allocator_memory::pinned_host;
      } else {
        bad_value(key, value, "device or pinned_host");
      }
    } else {
      throw invalid_argument("SHOAL_ALLOC_CONF: unknown key '" + std::string(key) +
                             "'; known keys: max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, "
                             "expandable_segments, debug, cross_stream_safety, release_idle_before_grow, memory_limit_mb, "
                             "memory_fraction, trace_entries, memory");
    }
  }
  return c;
}

allocator_config allocator_config::from_environment() {
  const char* text = std::getenv("SHOAL_ALLOC_CONF");
  return text != nullptr ? parse(text) : allocator_config{};
}

std::string allocator_config::to_string() const {
  std::ostringstream out;
  out << "expandable_segments:" << (expandable_segments ? "true" : "false") << ",debug:" << (debug ? "true" : "false")
      << ",cross_stream_safety:" << (cross_stream_safety ? "true" : "false")
      << ",release_idle_before_grow:" << (release_idle_before_grow ? "true" : "false")
      << ",max_non_split_rounding_mb:" << (max_non_split_rounding >> 20) << ",trace_entries:" << trace_entries;
  if (max_split_size != no_limit) out << ",max_split_size_mb:" << (max_split_size >> 20);
  if (memory_limit != no_limit) out << ",memory_limit_mb:" << (memory_limit >> 20);
  if (memory_fraction > 0) out << ",memory_fraction:" << memory_fraction;
  if (memory == allocator_memory::pinned_host) out << ",memory:pinned_host";
  // Divisions as a list over the intervals where they change; bounds are
  // whole MiB, so those below 1 MiB share one count (the interval before it).
  std::vector<std::string> parts;
  for (std::size_t i = 19; i < 64; ++i) {
    if (i + 1 == 64 || roundup_power2_divisions[i + 1] != roundup_power2_divisions[i]) {
      parts.push_back((i + 1 == 64 ? std::string(">") : std::to_string(std::size_t{1} << (i + 1 - 20))) + ":" +
                      std::to_string(roundup_power2_divisions[i]));
    }
  }
  bool any = false;
  for (auto d : roundup_power2_divisions) any = any || d > 1;
  if (any) {
    out << ",roundup_power2_divisions:[";
    for (std::size_t i = 0; i < parts.size(); ++i) out << (i ? "," : "") << parts[i];
    out << "]";
  }
  return out.str();
}

}  // namespace shoal::alloc
