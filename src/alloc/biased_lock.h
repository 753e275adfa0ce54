// A lock biased toward the one thread that keeps taking it: that thread
// (the owner) takes and gives it back with plain stores and loads, no
// atomic read-modify-write; any other thread takes it as a test-and-set
// lock and, the first time, revokes the bias.
//
// Each stream's pool is locked on every allocation and free, nearly always
// by one thread; the atomic exchange of a plain spin lock was half of a
// cached allocate/free pair (host profile).
//
// Each thread that ever owns a bias has a holder record (never freed; a
// record of a thread that ended goes to the next thread that needs one,
// unless its thread ended holding a lock, by either way),
// whose `inside` names the lock it is in by the fast way. Only its own
// thread writes it: a thread that lost a bias it was about to use can only
// clear its own record, never the flag of the thread that owns the bias now.
//
// The protocol (a Dekker handshake with asymmetric fences, asymmetric_fence.h):
// - owner: record.inside = this; light_fence(); enters when revoking_ is
//   false and owner_ still names its record, else clears record.inside and
//   takes the slow way like any thread. A thread already inside another
//   lock by the fast way takes the slow way (one slot a record).
// - any other thread: takes others_; if owner_ names another thread's
//   record, revoking_ = true; heavy_fence(); waits until that record is not
//   inside this lock; owner_ = none (revoked); revoking_ goes back to false
//   when it unlocks.
// The fences guarantee the owner sees revoking_ or the other thread sees
// its record inside, so never both inside; once owner_ is none, the old
// owner's re-check of owner_ (after its acquire load of revoking_) keeps it out.
// - a bias is given (owner_ = the thread's record) under others_, to a
//   thread that took the lock `threshold_` times in a row; a revocation
//   within 100 ms of the last one multiplies threshold_ by 4 (one later
//   starts it again from first_threshold), so a lock that changes hands
//   often soon stops being biased and its revocations (a membarrier each,
//   microseconds) stay rare. A streak that reaches first_threshold 100 ms
//   or more after the last revocation earns the bias then, whatever
//   threshold_ had grown to.
// - a look (look_at_each: statistics, read by another thread now and then)
//   is a revocation that leaves the bias where it is: revoking_ set, the
//   heavy fence, the owner waited out, then revoking_ cleared at the end;
//   owner_, the streak and the threshold stay. The owner, meanwhile, takes
//   the slow way and keeps its bias. Many locks looked at together share
//   one heavy fence.
// Without membarrier (asymmetric_fences_available) no bias is ever given:
// a test-and-set lock with two more relaxed loads.
// Misuse is a bug in the library: in Debug builds and with
// SHOAL_CHECK_INVARIANTS (checks_misuse()), a thread that takes the lock
// again while it holds it (by lock or try_lock, over a hold by either way),
// or gives back a hold it does not have,
// ends the process with a message (going on would hang, or let two holds be
// given back as one). There a hold by the other way of a lock biased to its
// holder marks the holder's record, so the record's fast way stays shut
// until it is given back. Other builds check nothing: a second take goes
// through or hangs, depending on the ways.
//
// Thread-safety: lock, try_lock and unlock from any thread (a Lockable, not
// recursive, not for signal handlers: a handler that took the lock between
// the owner's two steps would clear its record). biased_to_calling_thread
// and revocations read state that the lock guards: call them holding it, or
// with no thread using the lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "alloc/asymmetric_fence.h"
#include "alloc/spin_lock.h"

namespace shoal::alloc::detail {

/// One thread's record: the biased lock it is inside by the fast way, and
/// how many it holds by the other way (a record is handed to a later thread
/// only when both say none: a lock its thread ended holding stays held).
struct alignas(64) biased_lock_holder {
  std::atomic<const void*> inside{nullptr};  ///< written by its thread only
  std::uint32_t held_by_other_way = 0;       ///< read and written by its thread only
};

// Constant-initialized, hidden (see pool_directory.h's thread_cache): read
// inline on every lock and unlock.
namespace biased_lock_threads __attribute__((visibility("hidden"))) {
inline thread_local biased_lock_holder* mine = nullptr;
}  // namespace biased_lock_threads

// Every member function is hidden: two copies of the library in one
// process each keep their own records, and one copy's lock must never call
// into the other's (where `mine` is not the caller's record).
#define SHOAL_LOCK_LOCAL __attribute__((visibility("hidden")))

class biased_lock {
 public:
  [[gnu::always_inline]] SHOAL_LOCK_LOCAL void lock() noexcept {
    if (enter_as_owner()) [[likely]] return;
    lock_slowly();
  }

  [[nodiscard]] SHOAL_LOCK_LOCAL bool try_lock() noexcept {
    if (enter_as_owner()) return true;
    if (!others_.try_lock()) return refused_try();
    return try_become_exclusive();  // notes the holder
  }

  [[gnu::always_inline]] SHOAL_LOCK_LOCAL void unlock() noexcept {
    biased_lock_holder* me = biased_lock_threads::mine;
    if (me != nullptr && me->inside.load(std::memory_order_relaxed) == this) [[likely]] {
      me->inside.store(nullptr, std::memory_order_release);
      return;
    }
    unlock_slowly();
  }

  [[nodiscard]] SHOAL_LOCK_LOCAL bool biased_to_calling_thread() const noexcept {
    const biased_lock_holder* me = biased_lock_threads::mine;
    return me != nullptr && owner_.load(std::memory_order_relaxed) == me;
  }
  [[nodiscard]] std::uint32_t revocations() const noexcept { return revocations_; }
  /// Whether this build checks the lock's use (see the header's comment).
  [[nodiscard]] static bool checks_misuse() noexcept;

  /// Runs look(context, i) holding locks[i], for each i, and leaves every
  /// lock's bias with its thread: a look revokes nothing and counts toward
  /// no bias, so a thread reading statistics now and then costs the threads
  /// the locks are biased to only the wait. The locks nobody holds by the
  /// other way are taken together and share one heavy fence (one membarrier
  /// for all, not one a lock); the rest are looked at one at a time after.
  /// The caller holds no pool lock (one outside `locks` too: an owner
  /// inside one of them could be waiting for it), each lock appears once,
  /// and look neither throws nor takes a lock of the allocator. Throws
  /// std::bad_alloc before taking any lock.
  using look_function = void (*)(void* context, std::size_t i) noexcept;
  SHOAL_LOCK_LOCAL static void look_at_each(std::span<biased_lock* const> locks, look_function look, void* context);
  template <class Look>
  SHOAL_LOCK_LOCAL static void look_at_each(std::span<biased_lock* const> locks, Look&& look) {
    using callable = std::remove_reference_t<Look>;
    static_assert(std::is_nothrow_invocable_v<callable&, std::size_t>, "a look runs holding locks: it must not throw");
    look_at_each(locks, [](void* context, std::size_t i) noexcept { (*static_cast<callable*>(context))(i); },
                 static_cast<void*>(&look));
  }

  /// Taken this many times in a row by one thread, an unbiased lock is
  /// biased to it (before any revocation, or long after the last).
  static constexpr std::uint32_t first_threshold = 16;
  /// A revocation this long after the previous one starts the streak over
  /// at first_threshold; a closer one makes it 4 times longer.
  static constexpr std::chrono::milliseconds quiet_interval{100};

  /// Tests only: a revocation no longer waits for the owner to leave (the
  /// protection a test shows is needed). Never set outside a test.
  static inline std::atomic<bool> test_skip_waiting_for_owner{false};

 private:
  [[gnu::always_inline]] SHOAL_LOCK_LOCAL bool enter_as_owner() noexcept {
    biased_lock_holder* me = biased_lock_threads::mine;
    if (me == nullptr || owner_.load(std::memory_order_relaxed) != me) return false;
    if (me->inside.load(std::memory_order_relaxed) != nullptr) return false;  // in another lock by the fast way
    // Release (a plain store on x86): a revoker that reads this value, not
    // the null of this thread's last unlock, still sees that hold's writes.
    me->inside.store(this, fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_release);
    light_fence();
    if (!revoking_.load(fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_acquire) &&
        owner_.load(std::memory_order_relaxed) == me) [[likely]] {
      return true;
    }
    me->inside.store(nullptr, std::memory_order_release);
    return false;
  }

  // Out of line, so that lock() stays small where it is inlined: takes
  // others_ and becomes exclusive.
  [[gnu::noinline]] SHOAL_LOCK_LOCAL void lock_slowly() noexcept;
  // A hold taken by the other way: gives others_ back.
  [[gnu::noinline]] SHOAL_LOCK_LOCAL void unlock_slowly() noexcept;
  // Holding others_: makes the hold exclusive (revokes another thread's bias).
  SHOAL_LOCK_LOCAL void become_exclusive() noexcept;
  // Holding others_: as become_exclusive, but gives others_ back and returns
  // false rather than wait for an owner that is inside.
  [[nodiscard]] SHOAL_LOCK_LOCAL bool try_become_exclusive() noexcept;
  // try_become_exclusive without noting the holder.
  [[nodiscard]] SHOAL_LOCK_LOCAL bool try_become_exclusive_unnoted() noexcept;
  // Checking builds (checks_misuse()): a take by a thread that holds the
  // lock ends the process; a slow-way hold is noted (others_holder_, and
  // slow_hold_tag() in the holder's record when the lock is biased to it).
  SHOAL_LOCK_LOCAL void check_not_held_by_caller() const noexcept;
  // try_lock found others_ held: false (checked first: not by the caller).
  [[gnu::noinline]] [[nodiscard]] SHOAL_LOCK_LOCAL bool refused_try() const noexcept;
  SHOAL_LOCK_LOCAL void note_slow_hold() noexcept;
  // A hold by the other way just taken (not a look's): counted in the
  // calling thread's record, if it has one, until unlock_slowly.
  SHOAL_LOCK_LOCAL void count_hold_by_other_way() noexcept;
  [[nodiscard]] SHOAL_LOCK_LOCAL const void* slow_hold_tag() const noexcept;
  // Holding others_, revoking_ set and heavy_fence passed, the owner out.
  SHOAL_LOCK_LOCAL void revoke() noexcept;
  // Holding others_ for a look: true when it may run now (no bias, or the
  // caller's); else sets revoking_, and the look waits for the heavy fence
  // and for the owner to be out (owner_inside).
  [[nodiscard]] SHOAL_LOCK_LOCAL bool begin_look() noexcept;
  [[nodiscard]] SHOAL_LOCK_LOCAL bool owner_inside() const noexcept;
  // Holding others_, no bias: counts the caller's streak, may bias to it.
  SHOAL_LOCK_LOCAL void count_streak() noexcept;

  std::atomic<biased_lock_holder*> owner_{nullptr};  ///< the biased thread's record, or none
  std::atomic<bool> revoking_{false};                             ///< written under others_ only
  // Guarded by others_.
  std::uint32_t streak_ = 0;
  std::uint32_t threshold_ = first_threshold;
  std::uint32_t revocations_ = 0;
  std::uintptr_t last_taker_ = 0;
  std::int64_t last_revocation_ns_ = 0;
  biased_lock_holder* counted_in_ = nullptr;  ///< the record counting this hold by the other way
  // The thread holding others_ (its thread pointer), while checks_misuse().
  std::atomic<std::uintptr_t> others_holder_{0};
  spin_lock others_;
};

/// std::lock_guard for a biased_lock, always inlined. In a large
/// translation unit the compiler stops inlining lock_guard's constructor and
/// destructor (inline-unit-growth), and each hold on the allocation path
/// then pays two calls and their register saves (~40 instructions a pair).
class [[nodiscard]] biased_lock_guard {
 public:
  [[gnu::always_inline]] SHOAL_LOCK_LOCAL explicit biased_lock_guard(biased_lock& lock) noexcept : lock_(lock) {
    lock_.lock();
  }
  [[gnu::always_inline]] SHOAL_LOCK_LOCAL ~biased_lock_guard() { lock_.unlock(); }
  biased_lock_guard(const biased_lock_guard&) = delete;
  biased_lock_guard& operator=(const biased_lock_guard&) = delete;

 private:
  biased_lock& lock_;
};

#undef SHOAL_LOCK_LOCAL

}  // namespace shoal::alloc::detail
