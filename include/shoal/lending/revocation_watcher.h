// Watches a borrower for the lender's revokes on a thread of its own and
// calls back for each: how a model server learns that its turn is over while
// its serving loop runs (the callback sets an atomic flag the loop looks at
// between batches, or gives the region back itself: borrower::give_back may
// be called from it, since revocations() holds no connection).
//
// It reads with borrower::revocations() in waits of 10 ms, so stop() is seen
// within about that — plus a callback that runs, and up to a second when a
// late answer of the borrower is being read (borrower.h). Once stopped, it
// calls back no more: revokes it read but had not passed on go back to the
// borrower (borrower::return_revocations), and the next revocations() call,
// or a new watcher, returns them — so are the revoke whose callback threw and
// those after it (after a stop() from that callback: those after it only),
// less any whose give back the lender has confirmed meanwhile. A stop() from
// the callback puts them back before it returns, so the watcher's thread
// touches the borrower no more after a callback that stopped or destroyed
// it. Whatever the callback or revocations() throws ends the watcher;
// error() then holds it (the callback's failure first).
//
// Thread-safety: stop(), watching() and error() may be called from any
// thread, the callback included (there stop() does not wait for the thread).
// The callback runs on the watcher's thread, one call at a time, and may run
// before the constructor returns (for revokes read already). The watcher may
// be destroyed from its callback, once its constructor has returned and when
// no other thread can reach it: the thread then ends after the callback
// returns, and destroys the callback (its captures) there. No thread may call
// into a watcher being destroyed, and the callback must not wait for a thread
// that is stopping or destroying the watcher (the two would wait for each
// other). The borrower must outlive the thread; nothing else should read its
// revocations() while the watcher runs (one of the two readers would miss
// revokes the other read).
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "shoal/lending/borrower.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::lending {

class revocation_watcher {
 public:
  using callback = std::function<void(const borrower::revocation&)>;

  /// Starts watching `b`; `on_revoke` (not empty: invalid_argument) is
  /// called for each revoke not read yet.
  revocation_watcher(borrower& b, callback on_revoke);
  /// Stops, and waits for the thread unless called on it.
  ~revocation_watcher();
  revocation_watcher(const revocation_watcher&) = delete;
  revocation_watcher& operator=(const revocation_watcher&) = delete;

  /// Stops watching: no callback begins after it returns (on the watcher's
  /// thread: after the callback that calls it). Waits for the thread to end,
  /// except on the thread itself.
  void stop() noexcept;
  /// True until the watcher ends (stopped, or ended by an error).
  [[nodiscard]] bool watching() const noexcept;
  /// What ended the watcher early (the callback's exception or the
  /// connection's), or null.
  [[nodiscard]] std::exception_ptr error() const;

 private:
  struct __attribute__((visibility("hidden"))) state;  // hidden: the library's own
  std::shared_ptr<state> state_;
  std::mutex join_mutex_;
  std::thread thread_;
};

}  // namespace shoal::lending

#pragma GCC visibility pop
