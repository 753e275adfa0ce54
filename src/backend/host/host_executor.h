// One host stream: an in-order executor thread.
//
// Work is numbered as it is submitted (tickets b + 1, b + 2, ...); completed()
// is the ticket of the last work that finished, b at first. A point in the
// stream is a ticket: it has been passed once completed() >= ticket. That is
// all events need, so recording an event costs one counter read.
//
// A stream with a slot in the host event page keeps its completed count in
// the slot, where other processes read it; b is the count the slot's
// previous stream left (0 for a fresh slot or no slot), so the slot's count
// never goes back.
//
// Thread-safety: all members may be called from any thread.
// Invariant: b <= completed() <= submitted(); both only grow.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "backend/host/host_event_page.h"

namespace shoal::backend::detail {

class host_executor {
 public:
  /// `slot`: where the completed count is published; none keeps it private.
  explicit host_executor(std::optional<host_stream_slot> slot);
  /// Runs the remaining work, then stops the thread; then gives the slot back.
  ~host_executor();
  host_executor(const host_executor&) = delete;
  host_executor& operator=(const host_executor&) = delete;

  /// Enqueues `work`; returns its ticket. If it throws, the message is kept
  /// for take_error().
  std::uint64_t submit(std::function<void()> work);
  [[nodiscard]] std::uint64_t submitted() const;
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_acquire); }
  /// The slot in the host event page this stream publishes to, or nullptr.
  [[nodiscard]] const host_stream_slot* slot() const noexcept { return slot_ ? &*slot_ : nullptr; }
  /// Blocks until the stream has passed `ticket`.
  void wait_for(std::uint64_t ticket) const;
  /// The message of the first work that failed since the last call, or "".
  std::string take_error();

 private:
  void run();

  const std::optional<host_stream_slot> slot_;
  std::atomic<std::uint64_t> private_completed_{0};
  std::atomic<std::uint64_t>& completed_;  // the slot's counter, or private_completed_ without one

  mutable std::mutex mutex_;
  std::condition_variable has_work_;
  std::deque<std::function<void()>> queue_;  // guarded by mutex_
  std::uint64_t submitted_;                  // guarded by mutex_
  bool stopping_ = false;                    // guarded by mutex_
  std::string first_error_;                  // guarded by mutex_
  std::thread thread_;
};

}  // namespace shoal::backend::detail
