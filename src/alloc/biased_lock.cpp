#include "alloc/biased_lock.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "core/library_checks.h"

namespace shoal::alloc::detail {

namespace {

constexpr std::uint32_t last_threshold = std::uint32_t{1} << 20;
constexpr std::int64_t quiet_ns = std::chrono::nanoseconds(biased_lock::quiet_interval).count();

// Checked where the library checks itself (core/library_checks.h).
constexpr bool check_use = shoal::detail::library_checks_on;

// A misuse is a bug in the library's own locking, never a caller's doing:
// going on would hang, or let a hold be given back that nobody had.
[[noreturn]] void misused(const char* what) noexcept {
  std::fprintf(stderr, "shoal: a pool lock was misused: %s\n", what);
  std::abort();
}

std::uintptr_t calling_thread() noexcept {
#if defined(__x86_64__) || defined(__aarch64__)
  return reinterpret_cast<std::uintptr_t>(__builtin_thread_pointer());
#else
  static thread_local char name;
  return reinterpret_cast<std::uintptr_t>(&name);
#endif
}

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Records of threads that ended, for the next thread that needs one. Never
// destroyed: a thread may end after static destruction began.
struct holder_registry {
  std::mutex mutex;
  std::vector<biased_lock_holder*> spare;
  std::vector<biased_lock_holder*> kept_back;  ///< their threads ended holding a lock: never handed on
};
holder_registry& registry() {
  static auto* r = new holder_registry;
  return *r;
}

// Held across fork(), so that a child never starts with it held by a
// thread it does not have (its first record would wait for ever). A leaf:
// nothing is locked under it.
void lock_before_fork() { registry().mutex.lock(); }
void unlock_after_fork() { registry().mutex.unlock(); }

// At load, while one thread runs (as core/fork_released_sockets.cpp does).
// pthread_atfork fails only without memory for the handlers.
[[maybe_unused]] const bool fork_handlers_registered =
    (registry(), ::pthread_atfork(&lock_before_fork, &unlock_after_fork, &unlock_after_fork) == 0);

thread_local bool thread_ending = false;

// Hands the thread's record on when the thread ends. A record still inside
// a lock or holding one by the other way (its thread ended holding it) is
// kept out of circulation, so that lock stays held, as a test-and-set lock
// would: handed on, it would give the next thread the lock's bias, and that
// thread's fast way in beside the hold.
struct holder_return {
  holder_return() = default;
  holder_return(const holder_return&) = delete;
  holder_return& operator=(const holder_return&) = delete;
  ~holder_return() {
    thread_ending = true;
    biased_lock_holder* h = std::exchange(biased_lock_threads::mine, nullptr);
    if (h == nullptr) return;
    const bool holds_a_lock = h->inside.load(std::memory_order_relaxed) != nullptr || h->held_by_other_way != 0;
    try {
      auto& r = registry();
      std::lock_guard lock(r.mutex);
      (holds_a_lock ? r.kept_back : r.spare).push_back(h);
    } catch (...) {  // NOLINT(bugprone-empty-catch): no room to keep it: it stays unused
    }
  }
};

// The calling thread's record, made or taken on first need; nullptr when
// there is no memory for one, or the thread is ending (then it gets no bias).
biased_lock_holder* this_threads_holder() noexcept {
  if (biased_lock_threads::mine != nullptr) return biased_lock_threads::mine;
  if (thread_ending) return nullptr;
  try {
    static thread_local holder_return on_thread_end;  // constructed here, once a thread
    (void)on_thread_end;
    biased_lock_holder* h = nullptr;
    {
      auto& r = registry();
      std::lock_guard lock(r.mutex);
      if (!r.spare.empty()) {
        h = r.spare.back();
        r.spare.pop_back();
      }
    }
    biased_lock_threads::mine = h != nullptr ? h : new biased_lock_holder;
    return biased_lock_threads::mine;
  } catch (...) {
    return nullptr;
  }
}

bool inside(const biased_lock_holder* h, const biased_lock* lock, std::memory_order order) noexcept {
  return h->inside.load(order) == lock;
}

// After revoking_ is set and the heavy fence passed: the owner cannot enter
// by its fast way any more, so only one already inside is waited for.
void wait_for_owner_to_leave(const biased_lock_holder* owner, const biased_lock* lock) noexcept {
  if (biased_lock::test_skip_waiting_for_owner.load(std::memory_order_relaxed)) return;
  const auto order = fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_acquire;
  for (int spins = 0; inside(owner, lock, order); ++spins) {
    if (spins > 64) std::this_thread::yield();
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace

bool biased_lock::checks_misuse() noexcept { return check_use; }

// A slow-way hold of a lock biased to its holder marks the holder's record
// with this tag (the lock's address, never odd, plus one): the record's fast
// way is refused while it is not empty, so a second take comes to the checks.
const void* biased_lock::slow_hold_tag() const noexcept {
  return reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(this) | 1U);
}

void biased_lock::check_not_held_by_caller() const noexcept {
  const biased_lock_holder* me = biased_lock_threads::mine;
  const void* in = me != nullptr ? me->inside.load(std::memory_order_relaxed) : nullptr;
  if (in == this || in == slow_hold_tag() || others_holder_.load(std::memory_order_relaxed) == calling_thread()) {
    misused("taken again by the thread that holds it");
  }
}

bool biased_lock::refused_try() const noexcept {
  if constexpr (check_use) check_not_held_by_caller();
  return false;
}

void biased_lock::note_slow_hold() noexcept {
  others_holder_.store(calling_thread(), std::memory_order_relaxed);
  biased_lock_holder* me = biased_lock_threads::mine;
  if (me != nullptr && owner_.load(std::memory_order_relaxed) == me &&
      me->inside.load(std::memory_order_relaxed) == nullptr) {
    // Release: a revoker of another lock that reads the tag, not the null
    // of this thread's last fast-way unlock there, still sees that hold.
    me->inside.store(slow_hold_tag(), std::memory_order_release);
  }
}

void biased_lock::count_hold_by_other_way() noexcept {
  // After become_exclusive: a record it made for a bias it gave counts too.
  biased_lock_holder* me = biased_lock_threads::mine;
  if (me == nullptr) return;
  ++me->held_by_other_way;
  counted_in_ = me;
}

void biased_lock::lock_slowly() noexcept {
  if constexpr (check_use) check_not_held_by_caller();
  others_.lock();
  become_exclusive();
  count_hold_by_other_way();
  if constexpr (check_use) note_slow_hold();
}

void biased_lock::unlock_slowly() noexcept {
  if constexpr (check_use) {
    if (others_holder_.load(std::memory_order_relaxed) != calling_thread()) {
      misused("given back by a thread that does not hold it");
    }
    others_holder_.store(0, std::memory_order_relaxed);
    biased_lock_holder* me = biased_lock_threads::mine;
    if (me != nullptr && me->inside.load(std::memory_order_relaxed) == slow_hold_tag()) {
      me->inside.store(nullptr, std::memory_order_relaxed);
    }
  }
  if (counted_in_ != nullptr) --std::exchange(counted_in_, nullptr)->held_by_other_way;
  if (revoking_.load(std::memory_order_relaxed)) revoking_.store(false, std::memory_order_release);
  others_.unlock();
}

void biased_lock::become_exclusive() noexcept {
  biased_lock_holder* owner = owner_.load(std::memory_order_relaxed);
  if (owner == nullptr) return count_streak();
  // My own bias (my fast way saw a revoking_ that gave up since, or I am in
  // another lock by the fast way): nobody else enters by the fast way, and
  // others_ keeps the rest out.
  if (owner == biased_lock_threads::mine) return;
  revoking_.store(true, handshake_order);
  heavy_fence();
  wait_for_owner_to_leave(owner, this);
  revoke();
}

bool biased_lock::try_become_exclusive() noexcept {
  if (!try_become_exclusive_unnoted()) return false;
  count_hold_by_other_way();
  if constexpr (check_use) {
    check_not_held_by_caller();
    note_slow_hold();
  }
  return true;
}

bool biased_lock::try_become_exclusive_unnoted() noexcept {
  biased_lock_holder* owner = owner_.load(std::memory_order_relaxed);
  if (owner == nullptr) {
    count_streak();
    return true;
  }
  if (owner == biased_lock_threads::mine) return true;
  const bool skip = test_skip_waiting_for_owner.load(std::memory_order_relaxed);
  // Inside already: give up without the fence's cost.
  if (!skip && inside(owner, this, std::memory_order_relaxed)) {
    others_.unlock();
    return false;
  }
  revoking_.store(true, handshake_order);
  heavy_fence();
  if (!skip && inside(owner, this, fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_acquire)) {
    revoking_.store(false, std::memory_order_release);  // the bias stays
    others_.unlock();
    return false;
  }
  revoke();
  return true;
}

bool biased_lock::begin_look() noexcept {
  if constexpr (check_use) note_slow_hold();
  biased_lock_holder* owner = owner_.load(std::memory_order_relaxed);
  if (owner == nullptr || owner == biased_lock_threads::mine) return true;
  revoking_.store(true, handshake_order);
  return false;
}

bool biased_lock::owner_inside() const noexcept {
  if (test_skip_waiting_for_owner.load(std::memory_order_relaxed)) return false;
  return inside(owner_.load(std::memory_order_relaxed), this,
                fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_acquire);
}

void biased_lock::look_at_each(std::span<biased_lock* const> locks, look_function look, void* context) {
  enum class step : std::uint8_t { busy, waiting, done };
  std::vector<step> steps(locks.size(), step::busy);  // before any lock is taken: may throw
  const auto look_and_leave = [&](std::size_t i) noexcept {
    look(context, i);
    locks[i]->unlock_slowly();
    steps[i] = step::done;
  };
  // Those nobody holds by the other way, together: owner_ cannot change
  // while others_ is held, so each waits only for its owner to go out.
  std::size_t waiting = 0;
  for (std::size_t i = 0; i < locks.size(); ++i) {
    biased_lock& l = *locks[i];
    if constexpr (check_use) l.check_not_held_by_caller();
    if (!l.others_.try_lock()) continue;  // busy: looked at alone, below
    if (l.begin_look()) {
      look_and_leave(i);
    } else {
      steps[i] = step::waiting;
      ++waiting;
    }
  }
  if (waiting > 0) heavy_fence();
  // An owner inside one lock may wait for another of these (with the
  // allocator's lock order, only one it holds by neither way): each is let
  // go as soon as its own owner is out, so no wait here holds anyone back.
  for (int rounds = 0; waiting > 0; ++rounds) {
    for (std::size_t i = 0; i < locks.size(); ++i) {
      if (steps[i] != step::waiting || locks[i]->owner_inside()) continue;
      look_and_leave(i);
      --waiting;
    }
    if (rounds > 64) std::this_thread::yield();
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  for (std::size_t i = 0; i < locks.size(); ++i) {
    if (steps[i] != step::busy) continue;
    biased_lock& l = *locks[i];
    l.others_.lock();
    if (!l.begin_look()) {
      heavy_fence();
      wait_for_owner_to_leave(l.owner_.load(std::memory_order_relaxed), &l);
    }
    look_and_leave(i);
  }
}

void biased_lock::revoke() noexcept {
  owner_.store(nullptr, std::memory_order_relaxed);
  ++revocations_;
  const std::int64_t now = now_ns();
  threshold_ = now - last_revocation_ns_ > quiet_ns ? first_threshold : std::min(threshold_ * 4, last_threshold);
  last_revocation_ns_ = now;
  last_taker_ = calling_thread();
  streak_ = 1;
}

void biased_lock::count_streak() noexcept {
  const std::uintptr_t me = calling_thread();
  if (me != last_taker_) {
    last_taker_ = me;
    streak_ = 1;
    return;
  }
  ++streak_;
  // Long after the last revocation, the first streak long enough earns the
  // bias again: the lock's contention has ended (an unbiased lock has no
  // revocation that would start threshold_ over).
  if (streak_ == first_threshold && threshold_ > first_threshold && now_ns() - last_revocation_ns_ > quiet_ns) {
    threshold_ = first_threshold;
  }
  if (streak_ < threshold_ || !asymmetric_fences_available()) return;
  if (biased_lock_holder* h = this_threads_holder()) owner_.store(h, std::memory_order_relaxed);
}

}  // namespace shoal::alloc::detail
