// An object a Python wrapper owns and close() ends — a peer, a listener, a
// transfer engine, a borrower, a lender — while other threads may be using
// it with the GIL released.
//
// Each use holds a closable<T>::use: close() refuses new uses, waits for the
// uses in flight to end, and only then destroys the object (with the GIL
// released: destructors here wait on other processes and threads). So no
// call ever runs on a destroyed object. A use that may block waits in slices
// (wait_in_slices) and checks closing() between them, so a close() from
// another thread ends it within one slice; so does a signal (Ctrl-C raises
// KeyboardInterrupt), which is handled between slices.
//
// Thread-safety: every member may be called from any thread. enter() and
// close() are called with the GIL held; a use may be released without it.
#pragma once

#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "bindings.h"
#include "shoal/core/error.h"

namespace shoal::python {

/// What a use of a closed object raises: connections (Peer, Borrower) say
/// the connection is closed; other objects that an argument is unusable.
enum class closed_error { invalid_argument, connection_closed };

/// How long one slice of a blocking wait lasts: a close() or a Ctrl-C from
/// another thread is seen within it.
inline constexpr std::chrono::milliseconds wait_slice{100};

template <class T>
class closable {
 public:
  /// One use of the object; the object lives at least as long.
  class use {
   public:
    explicit use(const closable& owner) : owner_(&owner) {}
    use(const use&) = delete;
    use& operator=(const use&) = delete;
    ~use() { owner_->leave(); }
    T& operator*() const noexcept { return *owner_->object_; }
    T* operator->() const noexcept { return owner_->object_.get(); }
    /// Whether close() has begun: a use that waits gives up between slices.
    [[nodiscard]] bool closing() const noexcept { return owner_->closing_.load(std::memory_order_acquire); }

   private:
    const closable* owner_;
  };

  closable(const char* name, closed_error kind, std::unique_ptr<T> object)
      : name_(name), kind_(kind), object_(std::move(object)) {}
  closable(const closable&) = delete;
  closable& operator=(const closable&) = delete;
  ~closable() { close(); }

  /// A use of the object; throws the closed error once close() has begun.
  [[nodiscard]] use enter() const {
    {
      std::lock_guard lock(mutex_);
      if (!closing_.load(std::memory_order_relaxed) && object_ != nullptr) {
        ++uses_;
        return use(*this);
      }
    }
    throw_closed();
  }

  /// Refuses new uses, waits for those in flight (each ends within a slice
  /// when it waits on a peer, or within its own timeout when it sends), then
  /// destroys the object. Idempotent; with the GIL held or not.
  void close() {
    std::unique_ptr<T> gone;
    {
      std::optional<nanobind::gil_scoped_release> unlocked;
      if (PyGILState_Check() != 0) unlocked.emplace();
      std::unique_lock lock(mutex_);
      closing_.store(true, std::memory_order_release);
      uses_done_.wait(lock, [&] { return uses_ == 0; });
      gone = std::move(object_);
      lock.unlock();
      gone.reset();
    }
  }

  [[nodiscard]] bool closed() const {
    std::lock_guard lock(mutex_);
    return closing_.load(std::memory_order_relaxed);
  }

  [[noreturn]] void throw_closed() const {
    const std::string message = std::string(name_) + ": closed";
    if (kind_ == closed_error::connection_closed) throw connection_closed(message);
    throw invalid_argument(message);
  }

 private:
  void leave() const {
    std::lock_guard lock(mutex_);
    if (--uses_ == 0) uses_done_.notify_all();
  }

  const char* name_;
  closed_error kind_;
  mutable std::mutex mutex_;
  mutable std::condition_variable uses_done_;
  mutable std::size_t uses_ = 0;
  std::atomic<bool> closing_{false};
  std::unique_ptr<T> object_;  // set until close(); read by a use without the lock (close waits for it)
};

/// When a wait of `timeout` seconds (None: no limit) started now ends;
/// invalid_argument naming `who` for a timeout that is not a finite number >= 0.
inline std::optional<std::chrono::steady_clock::time_point> until_of(std::optional<double> timeout, const char* who) {
  const auto limit = deadline_of(timeout, who);
  if (!limit) return std::nullopt;
  return std::chrono::steady_clock::now() + *limit;
}

/// `seconds` as a person writes it (0.5, 10), for error messages.
inline std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds;
  return text.str();
}

/// Calls attempt(slice) with the GIL released until it returns a value, each
/// call waiting at most `slice` (and no later than `until`); between calls,
/// with the GIL held, handles signals (raising KeyboardInterrupt) and stops
/// when `u` is closing (the closed error). nullopt when `until` passed first.
template <class T, class Attempt>
auto wait_in_slices(const typename closable<T>::use& u, const closable<T>& owner,
                    std::optional<std::chrono::steady_clock::time_point> until, Attempt attempt)
    -> decltype(attempt(std::chrono::milliseconds{})) {
  for (;;) {
    auto slice = wait_slice;
    if (until) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*until - std::chrono::steady_clock::now());
      slice = std::clamp(left, std::chrono::milliseconds{0}, wait_slice);
    }
    {
      nanobind::gil_scoped_release released;
      if (auto got = attempt(slice)) return got;
    }
    if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
    if (u.closing()) owner.throw_closed();
    if (until && std::chrono::steady_clock::now() >= *until) return {};
  }
}

}  // namespace shoal::python
