// Watches a thread's detach: linking watched_detaches.cpp replaces
// pthread_detach for the whole test binary; it passes every call on to the
// real one, and on a thread inside a watching_detach scope first gives the
// watched thread (a kernel thread id) a while to end on its own. A thread
// that ends in that while had been told to stop before it was detached, so
// it could as well end during the real detach: glibc 2.36's pthread_detach
// marks the thread detached and then reads its descriptor again, which a
// thread ending in between (detached by then) frees with its stack.
#pragma once

#include <sys/types.h>

#include <chrono>

namespace shoal::testing {

class watching_detach {
 public:
  /// The calling thread's next pthread_detach is of `thread` (gettid's
  /// number); it waits up to `grace` for that thread to end first.
  explicit watching_detach(pid_t thread, std::chrono::milliseconds grace = std::chrono::milliseconds(50)) noexcept;
  ~watching_detach();
  watching_detach(const watching_detach&) = delete;
  watching_detach& operator=(const watching_detach&) = delete;

  /// Whether the detach ran in this scope.
  [[nodiscard]] bool detached() const noexcept;
  /// Whether the watched thread had ended when the detach reached the C library.
  [[nodiscard]] bool ended_before_detach() const noexcept;
};

/// The calling thread's kernel thread id.
[[nodiscard]] pid_t this_thread_id() noexcept;

}  // namespace shoal::testing
