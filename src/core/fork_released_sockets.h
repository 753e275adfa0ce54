// Sockets a fork() child lets go of at once. A peer learns that this
// process ended (or closed its end) when the last descriptor of the socket
// closes; a child that inherited one and outlives its parent would keep the
// peer waiting, and keep an abstract listening name bound, until it exits
// too. Inherited shoal objects are unusable in a child anyway (fork_epoch.h).
//
// In each child, every registered descriptor is replaced by a socket whose
// other end is closed (its number stays taken, so the inherited owner's
// eventual close() closes the placeholder and never a descriptor the child
// opened since; reads there see end of stream, as from a closed peer).
//
// Thread-safety: every member may be called from any thread at once.
#pragma once

namespace shoal::detail {

/// Keeps `fd` registered for its lifetime: construct it once the socket is
/// open, destroy it before the socket closes. May throw std::bad_alloc.
class fork_released_socket {
 public:
  explicit fork_released_socket(int fd);
  ~fork_released_socket();
  fork_released_socket(const fork_released_socket&) = delete;
  fork_released_socket& operator=(const fork_released_socket&) = delete;

 private:
  int fd_;
};

}  // namespace shoal::detail
