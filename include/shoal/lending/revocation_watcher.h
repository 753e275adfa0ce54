// Watches a borrower for the lender's revokes on a thread of its own and
// calls back for each: how a model server learns that its turn is over while
// its serving loop runs (the callback sets a flag the loop looks at between
// batches; the loop drops the region).
//
// It reads with borrower::revocations() in waits of 10 ms, so stop() ends it
// within about that (plus a callback that runs). A callback that throws, or a
// connection that fails (the lender gone, a malformed message), ends the
// watcher; error() then holds the exception. Revokes read after a callback
// that threw are not passed on (each revoke is returned once).
//
// Thread-safety: stop(), watching() and error() may be called from any
// thread, the callback included (there stop() does not wait for the thread,
// which ends once the callback returns). The callback runs on the watcher's
// thread, one call at a time. The borrower must outlive the watcher, and
// nothing else should read its revocations() while the watcher runs: each
// revoke is returned once, so one of the two readers would miss some.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "shoal/lending/borrower.h"

namespace shoal::lending {

class revocation_watcher {
 public:
  using callback = std::function<void(const borrower::revocation&)>;

  /// Starts watching `b`; `on_revoke` is called for each revoke not read yet.
  revocation_watcher(borrower& b, callback on_revoke);
  /// Stops and waits for the thread (unless called on it).
  ~revocation_watcher();
  revocation_watcher(const revocation_watcher&) = delete;
  revocation_watcher& operator=(const revocation_watcher&) = delete;

  /// Stops watching; waits for the thread to end, except on the thread itself.
  void stop() noexcept;
  /// True until the watcher ends (stopped, or ended by an error).
  [[nodiscard]] bool watching() const noexcept;
  /// What ended the watcher early (the callback's exception or the
  /// connection's), or null.
  [[nodiscard]] std::exception_ptr error() const;

 private:
  struct state;
  std::shared_ptr<state> state_;
  std::mutex join_mutex_;
  std::thread thread_;
};

}  // namespace shoal::lending
