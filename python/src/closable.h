// An object a Python wrapper owns and close() ends — a peer, a listener, a
// transfer engine, a borrower, a lender — while other threads may be using
// it with the GIL released.
//
// Each use holds a closable<T>::use. close() refuses new uses; the object is
// destroyed (with the GIL released: destructors here wait on other
// processes and threads) once no use is left, by close() or by the last use
// to end. So no call ever runs on a destroyed object. A use that may block
// waits in slices (wait_in_slices) and checks closing between them, so a
// close() from another thread ends it within one slice; so does a signal
// (Ctrl-C raises KeyboardInterrupt), handled between slices. A use that
// cannot be sliced (a send to a peer that stopped reading) is ended by the
// object's cancel step, which close() runs once two slices have passed.
//
// close() returns once the object is destroyed — except on a thread that is
// itself using it (a signal handler or a __del__ run inside a call), where
// waiting could never end: there it returns at once, and the call's end
// destroys the object; on a library thread running Python code (python_work:
// a finalizer run as a transfer engine's thread lets go of a source), which
// the destruction may join: there it returns at once, and the object goes
// with the last use or on a thread of its own (other close() calls then
// return once it is handed to that thread, not once it is gone); and in a
// fork() child while
// uses its parent's threads held at the fork remain (they never end there):
// the object is left.
// Inside an out-of-memory observer it is refused: the observer may run on
// the object's own thread (a transfer engine's), which its destruction
// joins.
//
// Thread-safety: every member may be called from any thread. enter() and
// close() are called with the GIL held; a use may end without it.
#pragma once

#include <unistd.h>

#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bindings.h"
#include "gil.h"
#include "shoal/core/error.h"

namespace shoal::python {

/// What a use of a closed object raises: connections (Peer, Borrower) say
/// the connection is closed; other objects that an argument is unusable.
enum class closed_error { invalid_argument, connection_closed };

/// How long one slice of a blocking wait lasts: a close() or a Ctrl-C from
/// another thread is seen within it.
inline constexpr std::chrono::milliseconds wait_slice{100};

namespace detail {

/// The closables this thread holds uses of, innermost last.
inline thread_local std::vector<const void*> uses_of_this_thread;
/// Above zero while this thread runs an out-of-memory observer.
inline thread_local int observer_depth = 0;

}  // namespace detail

/// Marks the calling thread as running an out-of-memory observer for its
/// life (close() is refused there).
struct observer_scope {
  observer_scope() noexcept { ++detail::observer_depth; }
  ~observer_scope() { --detail::observer_depth; }
  observer_scope(const observer_scope&) = delete;
  observer_scope& operator=(const observer_scope&) = delete;
};

template <class T>
class closable {
 public:
  /// One use of the object; the object lives at least as long.
  class use {
   public:
    explicit use(const closable& owner) : owner_(&owner) { detail::uses_of_this_thread.push_back(&owner); }
    use(const use&) = delete;
    use& operator=(const use&) = delete;
    ~use() {
      auto& held = detail::uses_of_this_thread;
      held.erase(std::find(held.rbegin(), held.rend(), owner_).base() - 1);
      owner_->leave();
    }
    T& operator*() const noexcept { return *owner_->object_; }
    T* operator->() const noexcept { return owner_->object_.get(); }
    /// Whether close() has begun: a use that waits gives up between slices.
    [[nodiscard]] bool closing() const noexcept { return owner_->closing_.load(std::memory_order_acquire); }

   private:
    const closable* owner_;
  };

  /// `cancel`, when given, ends a use that waits without slices (it runs
  /// while uses are in flight, so the object is alive; from any thread).
  closable(const char* name, closed_error kind, std::unique_ptr<T> object, std::function<void(T&)> cancel = {})
      : name_(name), kind_(kind), cancel_(std::move(cancel)), object_(std::move(object)) {}
  closable(const closable&) = delete;
  closable& operator=(const closable&) = delete;
  ~closable() {
    close();
    // Still in use only when the interpreter shuts down under a daemon
    // thread's call (close() does not wait then): the object stays for it.
    std::lock_guard lock(mutex_);
    if (uses_ > 0) (void)object_.release();  // NOLINT(bugprone-unused-return-value): left to the exiting process
  }

  /// A use of the object; throws the closed error once close() has begun.
  [[nodiscard]] use enter() const {
    if (!reserve()) throw_closed();
    return use(*this);
  }
  /// A use of the object, or nullopt once close() has begun.
  [[nodiscard]] std::optional<use> try_enter() const {
    if (!reserve()) return std::nullopt;
    return std::optional<use>(std::in_place, *this);
  }

  /// Refuses new uses and returns once the object is destroyed (see the
  /// file's comment for the two exceptions). Idempotent. A signal that
  /// arrives while it waits raises (the object is still destroyed, by the
  /// last use to end).
  void close() {
    std::unique_lock lock(mutex_);
    if (destroyed_) return;
    if (detail::observer_depth > 0) {
      throw invalid_argument(std::string(name_) +
                             ".close(): not inside an out-of-memory observer; close it once the allocation "
                             "has failed");
    }
    closing_.store(true, std::memory_order_release);
    const auto& held = detail::uses_of_this_thread;
    if (std::find(held.begin(), held.end(), this) != held.end()) return;  // this thread's use destroys it
    if (uses_ == 0 && object_ != nullptr) {
      destroy(lock);
      return;
    }
    // Python code a library thread runs (python_work: a finalizer as a transfer engine's
    // thread lets go of a source) never waits here: the uses' end could need that thread.
    if (detail::in_python_work > 0) return;
    // The interpreter shuts down (this wrapper is collected then): what is
    // still in use by a daemon thread goes with the process. So it goes in a
    // fork() child for uses its parent's threads held at the fork: those
    // threads are not there to end them.
    if (detail::interpreter_finalizing() || ::getpid() != owner_pid_) return;
    // Uses in flight, or another close() destroying it: wait for the end.
    // The lock is never held while the GIL is taken (the order is GIL, then lock).
    for (int slices = 1;; ++slices) {
      bool done = false;
      detail::without_gil(
          [&] {
            done = destroyed_cv_.wait_for(lock, wait_slice, [&] { return destroyed_; });
            if (!done && slices == 2 && cancel_ && uses_ > 0) {
              cancel_(*object_);  // two slices have passed: what still waits does not slice
            }
            lock.unlock();
          });
      if (done) return;
      if (detail::holds_gil() && PyErr_CheckSignals() != 0) throw nanobind::python_error();
      lock.lock();
    }
  }

  [[nodiscard]] bool closed() const noexcept { return closing_.load(std::memory_order_acquire); }

  [[noreturn]] void throw_closed() const {
    const std::string message = std::string(name_) + ": closed";
    if (kind_ == closed_error::connection_closed) throw connection_closed(message);
    throw invalid_argument(message);
  }

 private:
  bool reserve() const {
    std::lock_guard lock(mutex_);
    if (closing_.load(std::memory_order_relaxed)) return false;
    ++uses_;
    return true;
  }
  void leave() const {
    std::unique_lock lock(mutex_);
    if (--uses_ == 0 && closing_.load(std::memory_order_relaxed) && object_ != nullptr) destroy(lock);
  }
  // Under the lock, with no use left and the object set: destroys it with
  // the lock and the GIL released, then tells every close() waiting. Inside
  // python_work the object goes on a thread of its own: this thread may be
  // one the destruction joins (a transfer engine's, in a source's finalizer).
  void destroy(std::unique_lock<std::mutex>& lock) const {
    std::unique_ptr<T> gone = std::move(object_);
    lock.unlock();
    if (detail::in_python_work > 0) {
      T* const handed_off = gone.release();
      try {
        std::thread([handed_off] { delete handed_off; }).detach();  // NOLINT(cppcoreguidelines-owning-memory)
      } catch (...) {  // NOLINT(bugprone-empty-catch): no thread to be had: the object stays for the process
      }
    } else {
      detail::without_gil([&] { gone.reset(); });
    }
    lock.lock();
    destroyed_ = true;
    destroyed_cv_.notify_all();
  }

  const char* name_;
  closed_error kind_;
  const pid_t owner_pid_ = ::getpid();
  std::function<void(T&)> cancel_;
  mutable std::mutex mutex_;
  mutable std::condition_variable destroyed_cv_;
  mutable std::size_t uses_ = 0;
  mutable bool destroyed_ = false;
  std::atomic<bool> closing_{false};
  // Set until destroyed; a use reads it without the lock (nothing destroys
  // it while a use is left).
  mutable std::unique_ptr<T> object_;
};

/// When a wait of `timeout` seconds (None: no limit) started now ends;
/// invalid_argument naming `who` and `what` for a timeout that is not a
/// finite number >= 0.
inline std::optional<std::chrono::steady_clock::time_point> until_of(std::optional<double> timeout, const char* who,
                                                                     const char* what = "timeout") {
  const auto limit = deadline_of(timeout, who, what);
  if (!limit) return std::nullopt;
  return std::chrono::steady_clock::now() + *limit;
}

/// `seconds` as a person writes it (0.5, 10), for error messages.
inline std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds;
  return text.str();
}

/// What wait_in_slices is given when nothing but `until` ends a wait early.
struct never_done {
  bool operator()() const noexcept { return false; }
};

/// Calls attempt(slice) with the GIL released until it returns a value, each
/// call waiting at most `slice` (and no later than `until`); between calls,
/// with the GIL held, handles signals (raising KeyboardInterrupt), stops
/// when `u` is closing (the closed error), and returns nullopt when done()
/// is true (something the caller waits for besides the attempt: it tells
/// this from `until` passing, nullopt too, by asking again).
template <class T, class Attempt, class Done = never_done>
auto wait_in_slices(const typename closable<T>::use& u, const closable<T>& owner,
                    std::optional<std::chrono::steady_clock::time_point> until, Attempt attempt, Done done = {})
    -> decltype(attempt(std::chrono::milliseconds{})) {
  for (;;) {
    auto slice = wait_slice;
    if (until) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*until - std::chrono::steady_clock::now());
      slice = std::clamp(left, std::chrono::milliseconds{0}, wait_slice);
    }
    decltype(attempt(slice)) got;
    detail::without_gil([&] { got = attempt(slice); });
    if (got) return got;
    if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
    if (u.closing()) owner.throw_closed();
    if (done()) return {};
    if (until && std::chrono::steady_clock::now() >= *until) return {};
  }
}

}  // namespace shoal::python
