// Tells an object whether it lives on in a fork() child of the process that
// made it.
//
// Only the thread that called fork() comes along into the child. An object
// that owns worker threads must not, in the child, hand them work (it would
// never run), wait for their work, or destroy a condition variable they
// waited on (glibc waits for the parent's waiters to leave it: forever); and
// memory the parent maps shared is still shared with the child. Such an
// object keeps a fork_epoch made when it was, and asks it.
//
// Thread-safety: all members may be called from any thread; forked_since()
// is one relaxed load and a compare.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>

namespace shoal::detail {

/// Forks this process is a child of, counted down the line (a grandchild 2).
[[nodiscard]] std::uint64_t forks_so_far() noexcept;

class fork_epoch {
 public:
  fork_epoch() noexcept : made_at_(forks_so_far()) {}
  /// True in a fork() child (at any depth) of the process that made this.
  [[nodiscard]] bool forked_since() const noexcept;

 private:
  std::uint64_t made_at_;
};

/// In a fork() child, lets go of a parent's thread handle without join()
/// or detach(): glibc gives the dead thread's descriptor to the child's next
/// thread, which either call would then act on.
inline void leave_parents_thread(std::thread&& handle) noexcept { (void)new std::thread(std::move(handle)); }

namespace fork_counting {
// Bumped in each child by a pthread_atfork handler, registered when the
// library loads (fork_epoch.cpp).
extern std::atomic<std::uint64_t> forks;
}  // namespace fork_counting

inline bool fork_epoch::forked_since() const noexcept {
  return fork_counting::forks.load(std::memory_order_relaxed) != made_at_;
}

}  // namespace shoal::detail
