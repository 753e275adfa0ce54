// A file descriptor with one owner.
//
// Not thread-safe: one unique_fd is used by one thread at a time, like any
// value. Invariant: get() is either -1 or an open descriptor this object owns
// and closes exactly once.
#pragma once

#include <utility>

namespace shoal {

class unique_fd {
 public:
  unique_fd() noexcept = default;
  /// Takes ownership of `fd` (-1 for none).
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  unique_fd(unique_fd&& other) noexcept : fd_(other.release()) {}
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }

  /// Gives up ownership and returns the descriptor.
  int release() noexcept { return std::exchange(fd_, -1); }
  /// Closes the owned descriptor, if any, and takes `fd`.
  void reset(int fd = -1) noexcept;
  /// A new descriptor for the same open file (dup with close-on-exec).
  /// Throws backend_error when the system refuses.
  [[nodiscard]] unique_fd duplicate() const;

 private:
  int fd_ = -1;
};

}  // namespace shoal
