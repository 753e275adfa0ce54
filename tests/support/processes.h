// Process helpers shared by the tests: a temporary directory, a pipe, and a
// forked child that is always reaped.
//
// A forked child runs only async-signal-safe calls (socket, connect, read,
// write, setresuid, execv, _exit), since the test binary may have other
// threads.
#pragma once

#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>

#include "shoal/core/unique_fd.h"

namespace shoal::testing {

/// A fresh directory under /tmp, removed with everything in it.
class temp_dir {
 public:
  temp_dir() {
    char name[] = "/tmp/shoal-test-XXXXXX";
    EXPECT_NE(::mkdtemp(name), nullptr) << std::strerror(errno);
    path_ = name;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::string operator/(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

/// A pipe whose ends are close-on-exec.
struct pipe_ends {
  pipe_ends() {
    int ends[2];
    EXPECT_EQ(::pipe2(ends, O_CLOEXEC), 0);
    read.reset(ends[0]);
    write.reset(ends[1]);
  }
  unique_fd read, write;
};

/// Whether a forked child of a multi-threaded test may start threads: not
/// under the sanitizers (ThreadSanitizer ends such a child; under
/// AddressSanitizer its start may wait on a lock another thread held at the
/// fork).
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
inline constexpr bool forked_child_may_start_threads = false;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
inline constexpr bool forked_child_may_start_threads = false;
#else
inline constexpr bool forked_child_may_start_threads = true;
#endif
#else
inline constexpr bool forked_child_may_start_threads = true;
#endif

/// A forked child running `body`, whose result becomes the exit status.
/// `body` must call only async-signal-safe functions (or, in a test of what
/// shoal does in a fork() child, shoal and the C++ runtime, which glibc
/// makes safe to call after fork). The destructor kills and reaps a child
/// not yet waited for.
class forked_child {
 public:
  template <typename Body>
  explicit forked_child(Body body) {
    pid_ = ::fork();
    if (pid_ == 0) ::_exit(body());
    EXPECT_GT(pid_, 0) << std::strerror(errno);
  }
  forked_child(const forked_child&) = delete;
  forked_child& operator=(const forked_child&) = delete;
  ~forked_child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  [[nodiscard]] pid_t pid() const { return pid_; }
  /// Waits for the child; its exit status, or 128 + the signal that ended it.
  int wait() {
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  /// wait(), for at most `limit`: nothing when the child still runs then
  /// (the destructor kills it).
  std::optional<int> wait_for(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    for (;;) {
      int status = 0;
      const pid_t done = ::waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (std::chrono::steady_clock::now() >= until) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

 private:
  pid_t pid_ = -1;
};

}  // namespace shoal::testing
