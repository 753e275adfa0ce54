#include "core/fork_released_sockets.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <utility>
#include <vector>

namespace shoal::detail {

namespace {

bool is_still(const registered_socket& s) noexcept {
  struct stat now {};
  return ::fstat(s.fd, &now) == 0 && now.st_dev == s.device && now.st_ino == s.inode;
}

// Its lock is held across fork(), and by openings (socket() or accept4()
// and their registration), so that no fork() comes between the two.
struct registry {
  std::mutex mutex;
  std::vector<registered_socket> sockets;  // guarded by mutex
};

registry& sockets_to_release() {
  static auto* const r = new registry;  // never destroyed: a fork may come during exit
  return *r;
}

// A socket whose other end is closed, made before each fork while sockets
// are registered: in the child each registered descriptor becomes a copy of
// it, so reads there see end of stream, writes EPIPE and poll() POLLHUP —
// what shoal reports as connection_closed. -1 when none could be made.
int dead_socket = -1;  // guarded by the registry's lock

// The lock is held across fork(), so the child finds the list whole and the
// lock free (the forking thread, which holds it, is the child's one thread).
void lock_before_fork() noexcept {
  registry& r = sockets_to_release();
  r.mutex.lock();
  if (r.sockets.empty()) return;
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) return;
  ::close(ends[1]);
  dead_socket = ends[0];
}
void unlock_in_parent() noexcept {
  if (dead_socket >= 0) ::close(std::exchange(dead_socket, -1));
  sockets_to_release().mutex.unlock();
}
void release_in_child() noexcept {
  registry& r = sockets_to_release();
  // open, fstat, dup3 and close are async-signal-safe. Without a dead
  // socket, /dev/null (end of file too, though poll() calls it readable for
  // ever); without either (no descriptor left) the sockets stay as they were.
  const int placeholder = dead_socket >= 0 ? std::exchange(dead_socket, -1) : ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (placeholder >= 0) {
    for (const registered_socket& s : r.sockets) {
      if (is_still(s)) (void)::dup3(placeholder, s.fd, O_CLOEXEC);
    }
    ::close(placeholder);
  }
  r.sockets.clear();  // keeps its capacity: no allocation here
  r.mutex.unlock();
}

// At load, while one thread runs, as fork_epoch.cpp does. pthread_atfork
// fails only without memory for the handlers; children then keep the
// sockets as before.
[[maybe_unused]] const bool registered_at_load =
    (sockets_to_release(), ::pthread_atfork(&lock_before_fork, &unlock_in_parent, &release_in_child) == 0);

// Under the registry's lock. Nothing (fd -1) when `fd` is no open descriptor.
registered_socket register_socket(registry& r, int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return {};
  const registered_socket entry{fd, st.st_dev, st.st_ino};
  r.sockets.push_back(entry);
  return entry;
}

}  // namespace

fork_released_socket::fork_released_socket(int fd) {
  registry& r = sockets_to_release();
  std::lock_guard lock(r.mutex);
  registered_ = register_socket(r, fd);
}

fork_released_socket::fork_released_socket(const std::function<int()>& open) {
  registry& r = sockets_to_release();
  std::lock_guard lock(r.mutex);
  const int fd = open();
  if (fd < 0) return;
  const int opened_errno = errno;
  registered_ = register_socket(r, fd);
  errno = opened_errno;
}

fork_released_socket::~fork_released_socket() {
  if (registered_.fd < 0) return;
  registry& r = sockets_to_release();
  std::lock_guard lock(r.mutex);
  const auto it = std::find(r.sockets.begin(), r.sockets.end(), registered_);
  if (it == r.sockets.end()) return;  // in a fork() child: released already
  *it = r.sockets.back();
  r.sockets.pop_back();
}

}  // namespace shoal::detail
