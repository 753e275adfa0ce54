// A small test-and-test-and-set lock for short critical sections on the
// allocation path: one atomic exchange to take it uncontended (std::mutex
// costs two atomic operations and a possible syscall).
#pragma once

#include <atomic>
#include <thread>

namespace shoal::alloc::detail {

class spin_lock {
 public:
  void lock() noexcept {
    for (int spins = 0; locked_.exchange(true, std::memory_order_acquire); ++spins) {
      while (locked_.load(std::memory_order_relaxed)) {
        if (spins++ > 64) std::this_thread::yield();
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
  }
  [[nodiscard]] bool try_lock() noexcept { return !locked_.exchange(true, std::memory_order_acquire); }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace shoal::alloc::detail
