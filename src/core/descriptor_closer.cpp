#include "core/descriptor_closer.h"

#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

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

// One process's closer. Never destroyed: its detached thread may still run
// while the process exits, and in a fork() child the parent's, whose mutex a
// vanished thread may hold, is left untouched.
struct closer {
  std::uint64_t fork_generation = forks_so_far();
  std::mutex mutex;
  std::condition_variable has_work, made_progress;
  bool running = false;         // its thread was started; guarded by mutex
  std::deque<int> queue;        // guarded by mutex
  std::uint64_t handed = 0;     // descriptors handed over; guarded by mutex
  std::uint64_t closed = 0;     // of those, closed; guarded by mutex
};

std::atomic<closer*> current{nullptr};

void close_now(int fd) noexcept {
  // ENOTSOCK for any other kind: no fstat first, which a FUSE file could hold.
  const linger off{0, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &off, sizeof off);
  (void)::close(fd);
}

void run(closer* c) noexcept {
  std::unique_lock lock(c->mutex);
  for (;;) {
    c->has_work.wait(lock, [c] { return !c->queue.empty(); });
    const int fd = c->queue.front();
    c->queue.pop_front();
    lock.unlock();
    close_now(fd);
    lock.lock();
    ++c->closed;
    c->made_progress.notify_all();
  }
}

// Starts `c`'s thread with every signal blocked, so that no signal handler
// of the application's ever runs on it.
void start_thread(closer* c) {
  sigset_t all, before;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  try {
    std::thread(run, c).detach();
  } catch (...) {
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    throw;
  }
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
}

// This process's closer, made at the first call here and in each fork()
// child (its thread starts at the first hand-over).
closer& this_process_closer() {
  closer* c = current.load(std::memory_order_acquire);
  if (c != nullptr && c->fork_generation == forks_so_far()) return *c;
  auto made = std::make_unique<closer>();
  if (!current.compare_exchange_strong(c, made.get(), std::memory_order_acq_rel)) return *c;  // another thread's won
  return *made.release();
}

}  // namespace

void close_off_thread(int fd) noexcept {
  try {
    closer& c = this_process_closer();
    const std::lock_guard lock(c.mutex);
    if (!c.running) {
      start_thread(&c);
      c.running = true;
    }
    c.queue.push_back(fd);
    ++c.handed;
    c.has_work.notify_one();
    return;
  } catch (...) {  // NOLINT(bugprone-empty-catch): closed here instead, below
  }
  close_now(fd);
}

bool off_thread_closes_done_within(std::chrono::nanoseconds timeout) {
  closer* c = current.load(std::memory_order_acquire);
  if (c == nullptr || c->fork_generation != forks_so_far()) return true;
  std::unique_lock lock(c->mutex);
  const std::uint64_t target = c->handed;
  return c->made_progress.wait_for(lock, timeout, [&] { return c->closed >= target; });
}

}  // namespace shoal::detail
