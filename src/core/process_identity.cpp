#include "shoal/core/process_identity.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "shoal/core/error.h"
#include "shoal/core/unique_fd.h"

namespace shoal {

namespace {

struct stat_fields {
  char state;
  std::uint64_t start_time;
};

// /proc/<pid>/stat is "pid (comm) state ppid ...". comm is the executable's
// name, which may hold spaces and parentheses, so the fields start after the
// LAST ')'. The state is field 3 and the start time field 22.
std::optional<stat_fields> parse_stat(std::string_view text) {
  const std::size_t comm_end = text.rfind(')');
  if (comm_end == std::string_view::npos) return std::nullopt;
  std::string_view rest = text.substr(comm_end + 1);
  constexpr int first_field = 3;
  constexpr int start_time_field = 22;
  stat_fields fields{};
  for (int field = first_field; field <= start_time_field; ++field) {
    const std::size_t begin = rest.find_first_not_of(' ');
    if (begin == std::string_view::npos) return std::nullopt;
    rest.remove_prefix(begin);
    const std::string_view token = rest.substr(0, rest.find_first_of(" \n"));
    rest.remove_prefix(token.size());
    if (field == first_field) {
      if (token.size() != 1) return std::nullopt;
      fields.state = token.front();
    } else if (field == start_time_field) {
      const auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), fields.start_time);
      if (ec != std::errc() || end != token.data() + token.size()) return std::nullopt;
    }
  }
  return fields;
}

bool has_exited(char state) { return state == 'Z' || state == 'X' || state == 'x'; }

// True if a thread of `pid`'s group other than its leader is listed: a
// leader that left by pthread_exit() shows as a zombie while the process
// runs on in its other threads (which leave no zombies of their own).
bool other_threads_run(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/task";
  const std::unique_ptr<DIR, int (*)(DIR*)> tasks(::opendir(path.c_str()), &::closedir);
  if (!tasks) {
    // Gone meanwhile; anything else (out of descriptors, say) is no answer,
    // and an unknown process must not read as dead (its memory would go).
    if (errno == ENOENT || errno == ESRCH) return false;
    throw os_error{errno, "opendir(" + path + ")"};
  }
  const std::string leader = std::to_string(pid);
  for (;;) {
    errno = 0;
    const dirent* entry = ::readdir(tasks.get());
    if (entry == nullptr) break;
    const std::string_view name = entry->d_name;
    if (name != "." && name != ".." && name != leader) return true;
  }
  if (errno != 0 && errno != ENOENT && errno != ESRCH) throw os_error{errno, "readdir(" + path + ")"};
  return false;
}

}  // namespace

process_identity process_identity::self() {
  const pid_t pid = ::getpid();
  const std::optional<process_identity> me = identify_process(pid);
  if (!me) throw backend_error("identify_process(" + std::to_string(pid) + ")", "this process is missing from /proc");
  return *me;
}

std::optional<process_identity> identify_process(pid_t pid) {
  if (pid <= 0) return std::nullopt;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const unique_fd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!file) {
    if (errno == ENOENT || errno == ESRCH) return std::nullopt;
    throw os_error{errno, "open(" + path + ")"};
  }
  // The line is a few hundred bytes; field 22 comes well within the first 512.
  char buffer[2048];
  ssize_t got;
  do {
    got = ::read(file.get(), buffer, sizeof buffer);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    if (errno == ESRCH) return std::nullopt;  // reaped between open and read
    throw os_error{errno, "read(" + path + ")"};
  }
  if (got == 0) return std::nullopt;
  const std::optional<stat_fields> fields = parse_stat(std::string_view(buffer, static_cast<std::size_t>(got)));
  if (!fields) throw backend_error("parse " + path, "no state and start time (fields 3 and 22) after the command name");
  if (has_exited(fields->state) && !other_threads_run(pid)) return std::nullopt;
  return process_identity{pid, fields->start_time};
}

bool is_alive(const process_identity& process) {
  const std::optional<process_identity> now = identify_process(process.pid);
  return now && now->start_time == process.start_time;
}

}  // namespace shoal
