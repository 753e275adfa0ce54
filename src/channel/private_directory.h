// The directory a listener's socket file lies in, opened once and then used
// only through that descriptor: checked (a real directory of this uid, mode
// 0700), bound in (through /proc/self/fd/<descriptor>/<name>), and cleaned
// up. Renaming directories in its parent, between the check and the bind or
// later, cannot move the socket into another directory.
//
// Not thread-safe; the listener makes and drops it.
#pragma once

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/fork_released_sockets.h"
#include "shoal/core/unique_fd.h"

namespace shoal::channel::detail {

/// A sockaddr_un and the length bind or connect takes with it.
struct socket_address {
  sockaddr_un address{};
  socklen_t length = 0;
};

class private_directory {
 public:
  /// Opens `path`, creating it with mode 0700 when missing (its parent must
  /// exist), and checks the directory it opened. Throws invalid_argument when
  /// it is not a directory (a symbolic link included), not this uid's, or open
  /// to its group or others; backend_error when the system refuses.
  explicit private_directory(std::string path);
  /// Removes the directory when this object created it, is still at its path
  /// and is empty.
  ~private_directory();
  private_directory(const private_directory&) = delete;
  private_directory& operator=(const private_directory&) = delete;

  /// `name` in this directory, as an address that reaches it through the
  /// descriptor. Throws invalid_argument when that does not fit sockaddr_un.
  [[nodiscard]] socket_address address_of(const std::string& name) const;
  /// What `name` in this directory is (not following a link), or nullopt
  /// when there is none.
  [[nodiscard]] std::optional<struct stat> entry(const std::string& name) const;
  /// Removes `name` from this directory (none there is no error).
  void remove(const std::string& name) const;
  /// Whether a socket is bound to the socket file `name` here (listening,
  /// or between its bind and listen), without connecting to it (Linux; a
  /// system that does not answer the datagram check by type is asked with a
  /// stream connect, as a client would).
  /// invalid_argument when `name` is there and no socket.
  [[nodiscard]] bool someone_listens(const std::string& name) const;
  /// The names of the entries here, "." and ".." left out.
  [[nodiscard]] std::vector<std::string> names() const;
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  friend class start_lock;

  std::string path_;
  unique_fd fd_;
  bool created_ = false;
};

/// While it lives, no other listener (of any process) starts at `name` in
/// the directory, nor judges the socket file there stale: an exclusive flock
/// on the file `.<name>.lock` beside it, held by listeners from their look
/// for a stale socket file to their listen() (and while they remove one).
/// The lock file is removed, still locked, as the lock goes; a listener that
/// waited on a removed file locks the file the name holds then. A fork()
/// child's copy of the descriptor is released, so no child holds the lock.
/// The wait has a deadline (start_lock_wait): a process of this uid stopped,
/// or hostile, while it holds the lock holds no listener's start or end.
/// How long a start_lock waits: 2 s unless a test set another
/// (test_hook::set_start_lock_wait). Holders keep it for microseconds.
[[nodiscard]] std::chrono::milliseconds start_lock_wait() noexcept;

class start_lock {
 public:
  /// Waits for the lock up to start_lock_wait(). timeout_error when another
  /// process held it all that time; backend_error when the system refuses.
  start_lock(const private_directory& directory, const std::string& name);
  ~start_lock();
  start_lock(const start_lock&) = delete;
  start_lock& operator=(const start_lock&) = delete;

 private:
  /// Opens the lock file and waits for its lock until `until`; whether the
  /// name still holds the file locked.
  bool lock_the_file_named(std::chrono::steady_clock::time_point until);

  const private_directory& directory_;
  std::string file_name_;
  unique_fd file_;
  std::unique_ptr<shoal::detail::fork_released_socket> released_in_children_;
};

}  // namespace shoal::channel::detail
