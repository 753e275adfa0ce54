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
// In a fork() child of the process that made it the thread is gone: submit()
// and a wait that would block throw device_unavailable instead of hanging,
// and the destructor leaves the thread's state alone (leaked): destroying
// the condition variable the parent's thread waited on would block forever.
//
// Thread-safety: all members may be called from any thread.
// Invariant: b <= completed() <= submitted(); both only grow.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "backend/host/host_event_page.h"
#include "shoal/backend/host_device.h"
#include "core/fork_epoch.h"

namespace shoal::backend::detail {

class host_executor {
 public:
  /// `slot`: where the completed count is published; none keeps it private.
  /// `lag`: each work item waits a random time up to its max first, drawn
  /// from a generator seeded with the lag's seed and `number`.
  host_executor(std::optional<host_stream_slot> slot, const host_stream_lag& lag, std::uint64_t number);
  /// Runs the remaining work, then stops the thread (unless stop_when_drained
  /// let it run on alone); the slot goes back with the state's last owner.
  ~host_executor();
  /// The stream was destroyed: the thread, detached, runs the work queued and
  /// ends, while events recorded here (which share this object) still read
  /// and wait for its count. Nothing may be submitted after it. Once.
  void stop_when_drained();
  host_executor(const host_executor&) = delete;
  host_executor& operator=(const host_executor&) = delete;

  /// Enqueues `work`; returns its ticket. If it throws, the message is kept
  /// for take_error().
  std::uint64_t submit(std::function<void()> work);
  [[nodiscard]] std::uint64_t submitted() const;
  [[nodiscard]] std::uint64_t completed() const noexcept { return state_->completed.load(std::memory_order_acquire); }
  /// The slot in the host event page this stream publishes to, or nullptr.
  [[nodiscard]] const host_stream_slot* slot() const noexcept { return state_->slot ? &*state_->slot : nullptr; }
  /// Blocks until the stream has passed `ticket`.
  void wait_for(std::uint64_t ticket) const;
  /// The message of the first work that failed since the last call, or "".
  std::string take_error();

  /// Throws device_unavailable saying that `what` cannot be done in a
  /// fork() child with the parent's host device.
  [[noreturn]] static void throw_forked(const std::string& what);

 private:
  // Everything the thread uses, on the heap so that a fork() child can leave
  // it be.
  struct state {
    state(std::optional<host_stream_slot> s, const host_stream_lag& lag, std::uint64_t number);
    const std::optional<host_stream_slot> slot;
    std::atomic<std::uint64_t> private_completed{0};
    std::atomic<std::uint64_t>& completed;  // the slot's counter, or private_completed without one

    std::mutex mutex;
    std::condition_variable has_work;
    std::deque<std::function<void()>> queue;  // guarded by mutex
    // Written under mutex; read without it (a fork() child must not take a
    // mutex a parent's thread may have held at the fork).
    std::atomic<std::uint64_t> submitted;
    bool stopping = false;                    // guarded by mutex; no submit after it
    std::string first_error;                  // guarded by mutex
    const std::chrono::microseconds::rep lag_max;  // 0: no lag
    std::minstd_rand lag_random;                   // the thread's alone
    std::thread thread;
  };
  static void run(state& s);
  void throw_if_forked(const char* what) const;

  const shoal::detail::fork_epoch epoch_;
  std::shared_ptr<state> state_;  // shared with the thread
};

}  // namespace shoal::backend::detail
