// A file descriptor with one owner.
//
// Not thread-safe: one unique_fd is used by one thread at a time, like any
// value. Invariant: get() is either -1 or an open descriptor this object owns
// and closes exactly once.
//
// A descriptor a peer process passed (from_peer) may be of any kind the peer
// chose, and closing some kinds can block for as long as the peer likes (a
// socket set to linger with data it cannot send, a FUSE file whose flush the
// peer's daemon never answers). Such a descriptor is closed on the process's
// closer threads, never on the owner's, until mark_safe_to_close() says a
// check found it of a kind whose close cannot block (a memfd). It carries
// the uid of the peer that passed it: the closers let one peer's closes hold
// only a few of their threads.
#pragma once

#include <cstdint>
#include <utility>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal {

class unique_fd {
 public:
  unique_fd() noexcept = default;
  /// Takes ownership of `fd` (-1 for none).
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  /// Peer uid of a descriptor no one peer passed; (uid_t)-1, which no
  /// process runs as.
  static constexpr std::uint32_t no_one_peer = UINT32_MAX;

  /// Takes ownership of `fd`, a descriptor a peer of uid `peer_uid` passed
  /// (or one at whose other end it is): its close happens off the owner's
  /// thread (see above).
  [[nodiscard]] static unique_fd from_peer(int fd, std::uint32_t peer_uid = no_one_peer) noexcept {
    unique_fd owned(fd);
    owned.from_peer_ = fd >= 0;
    owned.peer_uid_ = peer_uid;
    return owned;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  unique_fd(unique_fd&& other) noexcept : fd_(other.fd_), from_peer_(other.from_peer_), peer_uid_(other.peer_uid_) {
    other.fd_ = -1;
    other.from_peer_ = false;
  }
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) {
      const bool peers = other.from_peer_;
      const std::uint32_t peer_uid = other.peer_uid_;
      reset(other.release());
      from_peer_ = peers && fd_ >= 0;
      peer_uid_ = peer_uid;
    }
    return *this;
  }
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  /// Whether closing it is left to the closer threads: a peer passed it and
  /// no check has found it safe to close in place.
  [[nodiscard]] bool closes_off_thread() const noexcept { return from_peer_; }
  /// Says a check found the descriptor of a kind whose close cannot block
  /// (a memfd, a driver's export): from now on it is closed in place.
  void mark_safe_to_close() noexcept { from_peer_ = false; }

  /// Gives up ownership and returns the descriptor; whoever takes it closes it.
  int release() noexcept {
    from_peer_ = false;
    return std::exchange(fd_, -1);
  }
  /// Closes the owned descriptor, if any (off this thread for a peer's), and
  /// takes `fd`, the caller's own.
  void reset(int fd = -1) noexcept;
  /// A new descriptor for the same open file (dup with close-on-exec), a
  /// peer's if this is. Throws backend_error when the system refuses.
  [[nodiscard]] unique_fd duplicate() const;

 private:
  int fd_ = -1;
  bool from_peer_ = false;
  std::uint32_t peer_uid_ = no_one_peer;  // whose, while from_peer_
};

}  // namespace shoal

#pragma GCC visibility pop
