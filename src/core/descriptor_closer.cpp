#include "core/descriptor_closer.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "core/fork_epoch.h"

namespace shoal::detail {

namespace {

// One process's closers. Never destroyed: their detached threads may still
// run while the process exits, and in a fork() child the parent's, whose
// mutex a vanished thread may hold, is left untouched.
struct closers {
  std::uint64_t fork_generation = forks_so_far();
  std::mutex mutex;
  std::condition_variable has_work, made_progress;
  std::size_t threads = 0;    // started; guarded by mutex
  std::size_t idle = 0;       // of those, waiting for work; guarded by mutex
  std::deque<int> queue;      // handed over, not yet taken; guarded by mutex
  std::uint64_t handed = 0;   // descriptors handed over; guarded by mutex
  std::uint64_t closed = 0;   // of those, closed; guarded by mutex
  std::atomic<bool> over_limit{false};  // queue.size() > closer_backlog_limit(), as last counted
  std::atomic<std::int64_t> last_close_ns{0};  // steady clock, when a close last returned
};

std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A queue over the limit is a backlog only once no close has returned for
// this long: a burst the threads work through (a producer's segments retired
// at once) is none.
constexpr std::int64_t stalled_after_ns = 100'000'000;

std::atomic<closers*> current{nullptr};

void close_now(int fd) noexcept {
  // ENOTSOCK for any other kind: no fstat first, which a FUSE file could hold.
  const linger off{0, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &off, sizeof off);
  (void)::close(fd);
}

// Under c.mutex.
void count_backlog(closers& c) noexcept {
  c.over_limit.store(c.queue.size() > closer_backlog_limit(), std::memory_order_relaxed);
}

void run(closers* c) noexcept {
  std::unique_lock lock(c->mutex);
  for (;;) {
    ++c->idle;
    c->has_work.wait(lock, [c] { return !c->queue.empty(); });
    --c->idle;
    const int fd = c->queue.front();
    c->queue.pop_front();
    count_backlog(*c);
    lock.unlock();
    close_now(fd);
    c->last_close_ns.store(steady_ns(), std::memory_order_relaxed);
    lock.lock();
    ++c->closed;
    c->made_progress.notify_all();
  }
}

// Starts one more thread with every signal blocked, so that no signal
// handler of the application's ever runs on it. Under c.mutex.
void start_thread(closers& c) {
  sigset_t all, before;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  try {
    std::thread(run, &c).detach();
  } catch (...) {
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    throw;
  }
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  ++c.threads;
}

// This process's closers, made at the first call here and in each fork()
// child.
closers& this_process_closers() {
  closers* c = current.load(std::memory_order_acquire);
  if (c != nullptr && c->fork_generation == forks_so_far()) return *c;
  auto made = std::make_unique<closers>();
  if (!current.compare_exchange_strong(c, made.get(), std::memory_order_acq_rel)) return *c;  // another thread's won
  return *made.release();
}

}  // namespace

std::size_t closer_backlog_limit() noexcept {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 4096;
  return std::clamp<std::size_t>(static_cast<std::size_t>(limit.rlim_cur / 4), 16, 4096);
}

bool closer_backlogged() noexcept {
  const closers* c = current.load(std::memory_order_acquire);
  // A fork() child's are its own (none until its first hand-over).
  return c != nullptr && c->over_limit.load(std::memory_order_relaxed) &&
         c->fork_generation == fork_counting::forks.load(std::memory_order_relaxed) &&
         steady_ns() - c->last_close_ns.load(std::memory_order_relaxed) > stalled_after_ns;
}

void close_off_thread(int fd) noexcept {
  try {
    closers& c = this_process_closers();
    const std::lock_guard lock(c.mutex);
    c.queue.push_back(fd);
    ++c.handed;
    count_backlog(c);
    // More waiting than threads free to take them (one notified may not
    // have woken yet: it is still counted idle, and takes the first).
    if (c.queue.size() > c.idle && c.threads < max_closer_threads) {
      try {
        start_thread(c);
      } catch (...) {
        if (c.threads == 0) {  // none to close it: taken back, closed here
          c.queue.pop_back();
          --c.handed;
          count_backlog(c);
          throw;
        }
      }
    }
    c.has_work.notify_one();
    return;
  } catch (...) {  // NOLINT(bugprone-empty-catch): closed here instead, below
  }
  close_now(fd);
}

bool off_thread_closes_done_within(std::chrono::nanoseconds timeout) {
  closers* c = current.load(std::memory_order_acquire);
  if (c == nullptr || c->fork_generation != forks_so_far()) return true;
  std::unique_lock lock(c->mutex);
  const std::uint64_t target = c->handed;
  return c->made_progress.wait_for(lock, timeout, [&] { return c->closed >= target; });
}

}  // namespace shoal::detail
