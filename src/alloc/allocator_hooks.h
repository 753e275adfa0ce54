// Callbacks other layers register with an allocator: cache-miss hooks (run
// before the device is asked for more memory), forced-clear hooks (run
// before a forced clear looks for blocks held outside) and release
// observers (told when device memory is given back), segment observers
// (told of every segment event: memory taken from the device or given back)
// and free-wait observers (told when a free starts to wait for streams and
// when that wait is over).
//
// Thread-safety: every member may be called from any thread. A callback
// runs under a shared lock, so remove() waits for calls in progress and a
// removed callback is never called afterwards. A hook may free blocks: the
// observers a free sets off on the hook's thread run under the hold that
// thread has (a std::shared_mutex must not be taken twice by one thread). A
// hook must not take device memory or give it back (allocate into growth,
// empty the cache), nor call remove(), which would wait for itself.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "shoal/alloc/stats.h"

namespace shoal::alloc::detail {

class allocator_hooks {
 public:
  using miss_hook = std::function<void()>;
  using release_observer = std::function<void(std::uintptr_t base, std::size_t bytes)>;
  using segment_observer = std::function<void(const segment_event&)>;
  using free_wait_observer = std::function<void(const free_wait_event&)>;

  std::uint64_t add_miss_hook(miss_hook hook);
  std::uint64_t add_forced_clear_hook(miss_hook hook);
  std::uint64_t add_release_observer(release_observer observer);
  std::uint64_t add_segment_observer(segment_observer observer);
  std::uint64_t add_free_wait_observer(free_wait_observer observer);
  /// Removes a hook or observer; an unknown id gives invalid_argument.
  void remove(std::uint64_t id);

  /// True when a cache miss has hooks to run (one relaxed load).
  [[nodiscard]] bool has_miss_hooks() const noexcept { return miss_count_.load(std::memory_order_relaxed) != 0; }
  void run_miss_hooks() const;
  void run_forced_clear_hooks() const;
  void notify_release(std::uintptr_t base, std::size_t bytes) const;
  /// True when segment events have observers (one relaxed load).
  [[nodiscard]] bool has_segment_observers() const noexcept {
    return segment_count_.load(std::memory_order_relaxed) != 0;
  }
  /// Tells every segment observer; what one throws is dropped (an observer
  /// only watches: the event has happened).
  void notify_segment(const segment_event& event) const noexcept;
  /// True when frees that wait have observers (one relaxed load).
  [[nodiscard]] bool has_free_wait_observers() const noexcept {
    return free_wait_count_.load(std::memory_order_relaxed) != 0;
  }
  /// Tells every free-wait observer; what one throws is dropped.
  void notify_free_wait(const free_wait_event& event) const noexcept;

 private:
  class shared_hold;
  /// Appends `callback` under a new id. Takes mutex_.
  template <class Callback>
  std::uint64_t add(std::vector<std::pair<std::uint64_t, Callback>>& to, Callback callback);
  /// Calls each of `observers` with `event` under the shared lock.
  template <class Observer, class Event>
  void tell(const std::vector<std::pair<std::uint64_t, Observer>>& observers, const Event& event) const noexcept;
  /// The relaxed counts from the lists. mutex_ held.
  void count_callbacks() noexcept;

  mutable std::shared_mutex mutex_;
  std::uint64_t next_id_ = 1;  // guarded by mutex_
  std::vector<std::pair<std::uint64_t, miss_hook>> miss_hooks_;                // guarded by mutex_
  std::vector<std::pair<std::uint64_t, miss_hook>> forced_clear_hooks_;        // guarded by mutex_
  std::vector<std::pair<std::uint64_t, release_observer>> release_observers_;  // guarded by mutex_
  std::vector<std::pair<std::uint64_t, segment_observer>> segment_observers_;  // guarded by mutex_
  std::vector<std::pair<std::uint64_t, free_wait_observer>> free_wait_observers_;  // guarded by mutex_
  std::atomic<std::size_t> miss_count_{0};
  std::atomic<std::size_t> segment_count_{0};
  std::atomic<std::size_t> free_wait_count_{0};
};

}  // namespace shoal::alloc::detail
