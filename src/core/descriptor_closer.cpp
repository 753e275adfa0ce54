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
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "core/fork_epoch.h"
#include "core/library_checks.h"

namespace shoal::detail {

namespace {

// The list of turns' own checks (core/library_checks.h): a breach is a bug
// in this file, and going on would follow a pointer into an owner already
// erased.
constexpr bool check_turns = library_checks_on;

void check_turns_invariant(bool holds, const char* invariant) noexcept {
  if (!check_turns || holds) return;
  std::fprintf(stderr, "shoal: the descriptor closer's list of turns is broken: %s\n", invariant);
  std::abort();
}

std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One owner's descriptors: erased once none waits and none is being closed.
struct owner_queue {
  closer_owner owner = unknown_owner;  // its key in closers::owners
  std::deque<int> waiting;      // handed over, not yet taken
  std::size_t closing = 0;      // taken by a thread, its close not returned
  bool ready = false;           // in closers' list of turns
  // Its neighbours in the list of turns, while ready: linked through the
  // owners themselves (map nodes stay put), so that listing one never
  // allocates, and never fails.
  owner_queue* previous_turn = nullptr;
  owner_queue* next_turn = nullptr;
  bool over_own_limit = false;  // waiting.size() > closer_owner_backlog_limit(), as last counted
  std::size_t counted = 0;      // what it adds to closers::within_limits_waiting
  std::int64_t progress_ns = steady_ns();  // made, or one of its closes last returned
};

// One process's closers. Never destroyed: their detached threads may still
// run while the process exits, and in a fork() child the parent's, whose
// mutex a vanished thread may hold, is left untouched (its queues hold
// numbers, which the child may have closed and reused since).
struct closers {
  std::uint64_t fork_generation = forks_so_far();
  std::mutex mutex;
  std::condition_variable has_work, made_progress;
  std::size_t threads = 0;  // started; guarded by mutex
  std::size_t idle = 0;     // of those, waiting for work; guarded by mutex
  std::map<closer_owner, owner_queue> owners;  // guarded by mutex
  // The list of turns: owners with a descriptor waiting and fewer than
  // max_closes_per_owner being closed, in turn; each once. Guarded by mutex.
  owner_queue* first_turn = nullptr;
  owner_queue* last_turn = nullptr;
  std::size_t turns = 0;
  std::size_t within_limits_waiting = 0;  // waiting, of owners within their own limit; guarded by mutex
  std::uint64_t handed = 0;               // descriptors handed over; guarded by mutex
  std::uint64_t closed = 0;               // of those, closed; guarded by mutex
  std::atomic<bool> over_limit{false};    // within_limits_waiting > closer_backlog_limit(), as last counted
  std::atomic<std::size_t> owners_over_limit{0};  // owners with over_own_limit
  std::atomic<std::int64_t> last_close_ns{0};     // steady clock, when any close last returned
  std::atomic<std::size_t> waiting_total{0};      // descriptors waiting, of every owner
};

// A queue over a limit is a backlog only once no close has returned for
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

// Brings the counts of `o`'s waiting descriptors up to date. Under c.mutex.
void count_backlog(closers& c, owner_queue& o) noexcept {
  const bool over = o.waiting.size() > closer_owner_backlog_limit();
  if (over != o.over_own_limit) {
    o.over_own_limit = over;
    if (over) {
      c.owners_over_limit.fetch_add(1, std::memory_order_relaxed);
    } else {
      c.owners_over_limit.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  const std::size_t counts = over ? 0 : o.waiting.size();
  c.within_limits_waiting = c.within_limits_waiting - o.counted + counts;
  o.counted = counts;
  c.over_limit.store(c.within_limits_waiting > closer_backlog_limit(), std::memory_order_relaxed);
}

// Lists `o` at the back of the turns when it has a descriptor waiting and
// room for another close. Under c.mutex.
void list_if_ready(closers& c, owner_queue& o) noexcept {
  if (o.ready || o.waiting.empty() || o.closing >= max_closes_per_owner) return;
  o.previous_turn = c.last_turn;
  o.next_turn = nullptr;
  (c.last_turn != nullptr ? c.last_turn->next_turn : c.first_turn) = &o;
  c.last_turn = &o;
  ++c.turns;
  o.ready = true;
}

// Takes `o` out of the turns, if it is in them. Under c.mutex.
void unlist(closers& c, owner_queue& o) noexcept {
  if (!o.ready) return;
  check_turns_invariant(c.turns > 0 && (o.previous_turn != nullptr || c.first_turn == &o),
                        "a listed owner is counted and linked");
  (o.previous_turn != nullptr ? o.previous_turn->next_turn : c.first_turn) = o.next_turn;
  (o.next_turn != nullptr ? o.next_turn->previous_turn : c.last_turn) = o.previous_turn;
  o.previous_turn = o.next_turn = nullptr;
  --c.turns;
  o.ready = false;
}

void start_thread(closers& c);

// Starts a thread when an owner's turn would find none free. Under c.mutex;
// throws when none can be started.
void start_thread_if_wanted(closers& c) {
  // One notified may not have woken yet: it is still counted idle, and takes the first.
  if (c.turns > c.idle && c.threads < max_closer_threads) start_thread(c);
}

void run(closers* c) noexcept {
  std::unique_lock lock(c->mutex);
  for (;;) {
    ++c->idle;
    c->has_work.wait(lock, [c] { return c->first_turn != nullptr; });
    --c->idle;
    owner_queue* const o = c->first_turn;
    unlist(*c, *o);
    const int fd = o->waiting.front();
    o->waiting.pop_front();
    c->waiting_total.fetch_sub(1, std::memory_order_relaxed);
    ++o->closing;
    count_backlog(*c, *o);
    list_if_ready(*c, *o);  // at the back: the other owners' turns come first
    try {
      start_thread_if_wanted(*c);
    } catch (...) {  // NOLINT(bugprone-empty-catch): this thread goes on with the others
    }
    lock.unlock();
    close_now(fd);
    const std::int64_t now = steady_ns();
    c->last_close_ns.store(now, std::memory_order_relaxed);
    lock.lock();
    --o->closing;  // still listed: an owner goes once nothing of it is closing (map nodes stay put)
    o->progress_ns = now;
    list_if_ready(*c, *o);
    if (o->waiting.empty() && o->closing == 0) {
      // A listed owner erased would leave the turns pointing at freed memory.
      check_turns_invariant(!o->ready, "an owner erased is not listed");
      c->owners.erase(o->owner);
    }
    if (c->first_turn != nullptr) c->has_work.notify_one();
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

bool stalled_since(std::int64_t ns) noexcept { return steady_ns() - ns > stalled_after_ns; }

}  // namespace

std::size_t closer_backlog_limit() noexcept {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 4096;
  return std::clamp<std::size_t>(static_cast<std::size_t>(limit.rlim_cur / 4), 16, 4096);
}

std::size_t closer_owner_backlog_limit() noexcept { return std::max<std::size_t>(closer_backlog_limit() / 4, 4); }

bool closer_backlogged(closer_owner owner) noexcept {
  closers* c = current.load(std::memory_order_acquire);
  // A fork() child's are its own (none until its first hand-over).
  if (c == nullptr || c->fork_generation != fork_counting::forks.load(std::memory_order_relaxed)) return false;
  if (c->over_limit.load(std::memory_order_relaxed) && stalled_since(c->last_close_ns.load(std::memory_order_relaxed))) {
    return true;
  }
  if (c->owners_over_limit.load(std::memory_order_relaxed) == 0) return false;
  const std::lock_guard lock(c->mutex);
  const auto found = c->owners.find(owner);
  if (found == c->owners.end() || !found->second.over_own_limit) return false;
  // A burst the threads work through is no backlog; a queue past twice the
  // limit is, however often one of its closes returns.
  return stalled_since(found->second.progress_ns) ||
         found->second.waiting.size() > 2 * closer_owner_backlog_limit();
}

bool closer_holds_accepts() noexcept {
  closers* c = current.load(std::memory_order_acquire);
  if (c == nullptr || c->fork_generation != fork_counting::forks.load(std::memory_order_relaxed)) return false;
  return c->waiting_total.load(std::memory_order_relaxed) > 2 * closer_backlog_limit();
}

void close_off_thread(int fd, closer_owner owner) noexcept {
  try {
    closers& c = this_process_closers();
    const std::lock_guard lock(c.mutex);
    owner_queue& o = c.owners[owner];
    o.owner = owner;
    try {
      o.waiting.push_back(fd);
    } catch (...) {  // not queued: closed below; a new owner's entry goes again
      if (o.waiting.empty() && o.closing == 0) c.owners.erase(owner);
      throw;
    }
    list_if_ready(c, o);
    ++c.handed;
    c.waiting_total.fetch_add(1, std::memory_order_relaxed);
    count_backlog(c, o);
    try {
      start_thread_if_wanted(c);
    } catch (...) {
      if (c.threads == 0) {  // none to close it: taken back, closed here
        o.waiting.pop_back();
        --c.handed;
        c.waiting_total.fetch_sub(1, std::memory_order_relaxed);
        count_backlog(c, o);
        if (o.waiting.empty()) {
          unlist(c, o);
          c.owners.erase(owner);
        }
        throw;
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
