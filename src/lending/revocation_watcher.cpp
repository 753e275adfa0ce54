#include "shoal/lending/revocation_watcher.h"

#include <atomic>
#include <chrono>
#include <span>
#include <utility>

#include "core/fork_epoch.h"
#include "shoal/core/error.h"

namespace shoal::lending {

namespace {
constexpr std::chrono::milliseconds look_every{10};  // how soon stop() is seen
}  // namespace

// Shared with the thread, which may outlive the watcher object when the
// watcher is destroyed from its own callback.
struct revocation_watcher::state {
  borrower& watched;
  callback on_revoke;
  const shoal::detail::fork_epoch epoch;  // the thread is not in a fork() child
  std::atomic<bool> stopping{false};
  std::atomic<bool> running{true};
  std::atomic<std::thread::id> thread_id{};  // set by the thread before any callback
  mutable std::mutex error_mutex;
  std::exception_ptr error;  // under error_mutex
  // The thread's own: the revokes of its batch after the one being passed
  // on, and whether a stop() from the callback put them back already.
  std::span<const borrower::revocation> after_this;
  bool put_back = false;

  state(borrower& b, callback f) : watched(b), on_revoke(std::move(f)) {}

  void keep_error(std::exception_ptr e) noexcept {
    const std::lock_guard lock(error_mutex);
    if (!error) error = std::move(e);
  }

  // On the thread, from the callback: the rest of the batch goes back now,
  // while the borrower is surely alive (the watcher may be destroyed next,
  // and nothing then tells its owner when this thread is done with it).
  void stopped_by_callback() noexcept {
    if (put_back) return;
    put_back = true;
    try {
      watched.return_revocations(after_this);
    } catch (...) {
      keep_error(std::current_exception());  // out of host memory: those revokes are lost, and said so
    }
  }

  void run() noexcept {
    thread_id.store(std::this_thread::get_id());
    try {
      while (!stopping.load()) {
        const auto batch = watched.revocations(look_every);
        for (std::size_t i = 0; i < batch.size(); ++i) {
          const auto rest = std::span(batch).subspan(i);
          if (stopping.load()) {  // stopped by another thread: no more calls
            watched.return_revocations(rest);
            break;
          }
          after_this = rest.subspan(1);
          try {
            on_revoke(batch[i]);
          } catch (...) {
            // This one too, unless a stop() from the callback put the rest
            // back already (the watcher, and so the borrower, may be gone).
            if (!put_back) {
              try {
                watched.return_revocations(rest);
              } catch (...) {  // NOLINT(bugprone-empty-catch): the callback's failure is the one kept
              }
            }
            throw;
          }
          if (put_back) break;  // stopped (or destroyed) by the callback: the rest is back
        }
      }
    } catch (...) {
      keep_error(std::current_exception());
    }
    running.store(false);
  }
};

revocation_watcher::revocation_watcher(borrower& b, callback on_revoke) {
  if (!on_revoke) throw invalid_argument("lending::revocation_watcher: an empty callback");
  state_ = std::make_shared<state>(b, std::move(on_revoke));
  thread_ = std::thread([s = state_] { s->run(); });
}

revocation_watcher::~revocation_watcher() {
  stop();
  if (thread_.joinable()) thread_.detach();  // destroyed from its own callback: it ends once that returns
}

void revocation_watcher::stop() noexcept {
  state_->stopping.store(true);
  if (state_->thread_id.load() == std::this_thread::get_id()) {  // from the callback: the thread ends after it
    state_->stopped_by_callback();
    return;
  }
  const std::lock_guard lock(join_mutex_);  // stops from several threads: one joins
  if (!thread_.joinable()) return;
  if (state_->epoch.forked_since()) {
    // A fork() child: the thread stayed with the parent.
    shoal::detail::leave_parents_thread(std::move(thread_));
    return;
  }
  thread_.join();
}

bool revocation_watcher::watching() const noexcept { return state_->running.load(); }

std::exception_ptr revocation_watcher::error() const {
  const std::lock_guard lock(state_->error_mutex);
  return state_->error;
}

}  // namespace shoal::lending
