// Sockets a fork() child lets go of at once. A peer learns that this
// process ended (or closed its end) when the last descriptor of the socket
// closes; a child that inherited one and outlives its parent would keep the
// peer waiting, and keep an abstract listening name bound, until it exits
// too. Inherited shoal objects are unusable in a child anyway (fork_epoch.h).
//
// In each child, every registered descriptor that is still the socket it
// was when registered (same device and inode) is replaced by a socket whose
// other end is closed (its number stays taken, so the inherited owner's
// eventual close() closes the placeholder and never a descriptor the child
// opened since; reads there see end of stream, as from a closed peer). A
// registration that outlives its socket's close is harmless: whatever
// reuses the number is another file, and is left as it is.
//
// Thread-safety: every member may be called from any thread at once.
#pragma once

#include <sys/types.h>

#include <functional>

namespace shoal::detail {

/// A registered descriptor and the file it named then: after a close, its
/// number may name another file. fd -1: nothing registered.
struct registered_socket {
  int fd = -1;
  dev_t device = 0;
  ino_t inode = 0;
  friend bool operator==(const registered_socket&, const registered_socket&) = default;
};

/// Keeps a socket registered for its lifetime. May throw std::bad_alloc.
class fork_released_socket {
 public:
  /// Registers `fd`, an open socket (nothing is registered when it is not
  /// an open descriptor).
  explicit fork_released_socket(int fd);
  /// Calls `open` (socket(), accept4(): a new descriptor, or -1 with errno
  /// set) and registers what it opened with no fork() in between: a fork()
  /// by another thread waits for both, so no child copies the socket
  /// unregistered. `open` must not block, nor open a registration itself.
  /// When it fails nothing is registered, and errno is as it left it. An
  /// exception from `open` passes through.
  explicit fork_released_socket(const std::function<int()>& open);
  ~fork_released_socket();
  fork_released_socket(const fork_released_socket&) = delete;
  fork_released_socket& operator=(const fork_released_socket&) = delete;

 private:
  // The file too: a stale registration must never take a newer one's entry away.
  registered_socket registered_;
};

}  // namespace shoal::detail
