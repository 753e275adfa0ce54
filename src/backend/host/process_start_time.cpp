#include "backend/host/process_start_time.h"

#include <charconv>
#include <fstream>
#include <iterator>
#include <string>

namespace shoal::backend::detail {

std::optional<std::uint64_t> process_start_time(pid_t pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so
  // the fields are counted from the last ')'.
  const auto comm_end = stat.rfind(')');
  if (comm_end == std::string::npos || comm_end + 2 >= stat.size()) return std::nullopt;
  const char state = stat[comm_end + 2];
  if (state == 'Z' || state == 'X' || state == 'x') return std::nullopt;  // exited, not yet reaped
  // Field 3 (state) starts at comm_end + 2; field 22 is 19 separators on.
  std::size_t at = comm_end + 2;
  for (int field = 3; field < 22; ++field) {
    at = stat.find(' ', at);
    if (at == std::string::npos) return std::nullopt;
    ++at;
  }
  std::uint64_t start = 0;
  if (std::from_chars(stat.data() + at, stat.data() + stat.size(), start).ec != std::errc{}) return std::nullopt;
  return start;
}

}  // namespace shoal::backend::detail
