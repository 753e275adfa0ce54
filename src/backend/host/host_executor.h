// One host stream: an in-order executor thread.
//
// Work is numbered as it is submitted (tickets 1, 2, 3, ...); completed()
// is the ticket of the last work that finished. A point in the stream is a
// ticket: it has been passed once completed() >= ticket. That is all events
// need, so recording an event costs one counter read.
//
// Thread-safety: all members may be called from any thread.
// Invariant: completed() <= submitted(); both only grow.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace shoal::backend::detail {

class host_executor {
 public:
  host_executor();
  /// Runs the remaining work, then stops the thread.
  ~host_executor();
  host_executor(const host_executor&) = delete;
  host_executor& operator=(const host_executor&) = delete;

  /// Enqueues `work`; returns its ticket. If it throws, the message is kept
  /// for take_error().
  std::uint64_t submit(std::function<void()> work);
  [[nodiscard]] std::uint64_t submitted() const;
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_acquire); }
  /// Blocks until the stream has passed `ticket`.
  void wait_for(std::uint64_t ticket) const;
  /// The message of the first work that failed since the last call, or "".
  std::string take_error();

 private:
  void run();

  mutable std::mutex mutex_;
  std::condition_variable has_work_;
  std::deque<std::function<void()>> queue_;  // guarded by mutex_
  std::uint64_t submitted_ = 0;              // guarded by mutex_
  bool stopping_ = false;                    // guarded by mutex_
  std::string first_error_;                  // guarded by mutex_
  std::atomic<std::uint64_t> completed_{0};
  std::thread thread_;
};

}  // namespace shoal::backend::detail
