// Starting a helper process connected to this one by a UNIX socket.
//
// The child gets its end of a socketpair as descriptor `child_socket_fd`
// (3), and nothing else of the parent's beyond stdin/stdout/stderr (every
// shoal descriptor is close-on-exec). Used by tools and tests to hand
// shared memory to another process.
//
// Thread-safety: a child_process is used by one thread at a time.
// Invariant: the destructor never leaves a zombie: it waits for the child,
// killing it first if it is still running.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "shoal/core/unique_fd.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal {

class child_process {
 public:
  static constexpr int child_socket_fd = 3;

  /// Starts `program` with `arguments` (argv[1..]). Throws backend_error if
  /// the process cannot be started.
  child_process(const std::string& program, const std::vector<std::string>& arguments);
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  ~child_process();

  /// The parent's end of the socket.
  [[nodiscard]] int socket() const noexcept { return socket_.get(); }
  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  /// Waits for the child to exit; returns its exit status, or 128 + signal
  /// number if a signal ended it.
  int wait();

 private:
  unique_fd socket_;
  pid_t pid_ = -1;
};

}  // namespace shoal

#pragma GCC visibility pop
