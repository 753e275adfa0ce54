// Makes thread creation fail on demand, as a pids cgroup limit or
// RLIMIT_NPROC does (pthread_create: EAGAIN, so std::thread throws
// std::system_error). Linking refused_threads.cpp replaces pthread_create
// for the whole test binary; it passes every call on to the real one except
// on a thread inside a refusing_threads scope, once that scope's allowance
// is spent.
#pragma once

namespace shoal::testing {

class refusing_threads {
 public:
  /// The calling thread may start `allowed` more threads; each later try fails.
  explicit refusing_threads(int allowed) noexcept;
  ~refusing_threads();
  refusing_threads(const refusing_threads&) = delete;
  refusing_threads& operator=(const refusing_threads&) = delete;

  /// How many thread creations were refused in this scope so far.
  [[nodiscard]] int refused() const noexcept;
};

}  // namespace shoal::testing
