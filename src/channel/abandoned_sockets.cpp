// listener::remove_abandoned_sockets: the socket files of killed servers
// that named them by pid, removed from a listener's own checked directory.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <ctime>
#include <optional>
#include <string>

// The public header in a block of its own, first: its hidden forward
// declarations must come before the definitions private_directory.h brings
// (an attribute after a definition is ignored, with a warning).
#include "shoal/channel/channel.h"

#include "channel/private_directory.h"
#include "shoal/core/error.h"

namespace shoal::channel {

namespace {

/// The pid in `<prefix><pid>-<rest>.sock`, or nullopt for another name.
std::optional<pid_t> pid_in(std::string_view name, std::string_view prefix) {
  constexpr std::string_view suffix = ".sock";
  if (!name.starts_with(prefix) || !name.ends_with(suffix)) return std::nullopt;
  const std::string_view rest = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  pid_t pid = 0;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), pid);
  if (ec != std::errc() || pid <= 0 || end == rest.data() + rest.size() || *end != '-') return std::nullopt;
  return pid;
}

// A socket file younger than this is left: its listener may not listen yet.
constexpr std::time_t min_age_seconds = 10;

bool runs(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }  // EPERM: another user's process

}  // namespace

std::size_t listener::remove_abandoned_sockets(std::string_view prefix) const {
  if (!directory_) return 0;
  std::size_t removed = 0;
  for (const std::string& name : directory_->names()) {
    const std::optional<pid_t> pid = pid_in(name, prefix);
    // A pid that runs may be a live server's, or a new process that took a
    // dead one's pid: not this sweep's to judge either way.
    if (!pid || runs(*pid) || name == file_name_) continue;
    try {
      const detail::start_lock starting(*directory_, name);  // no listener replaces the file meanwhile
      const std::optional<struct stat> st = directory_->entry(name);
      // Another user's file (root may put one here) is not this sweep's; nor
      // a fresh one, which may be a listener's between its bind and its listen
      // (which a stream connect takes for a dead one's); what is no socket, a link included,
      // someone_listens refuses (kept, below).
      if (!st || st->st_uid != ::geteuid() || std::time(nullptr) - st->st_mtime < min_age_seconds ||
          directory_->someone_listens(name)) {
        continue;
      }
      directory_->remove(name);
      ++removed;
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): an entry that cannot be judged is left
    }
  }
  return removed;
}

}  // namespace shoal::channel
