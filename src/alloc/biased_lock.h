// A lock biased toward the one thread that keeps taking it: that thread
// (the owner) takes and gives it back with plain stores and loads, no
// atomic read-modify-write; any other thread takes it as a test-and-set
// lock and, the first time, revokes the bias.
//
// Each stream's pool is locked on every allocation and free, nearly always
// by one thread; the atomic exchange of a plain spin lock was half of a
// cached allocate/free pair.
//
// The protocol (a Dekker handshake with asymmetric fences, asymmetric_fence.h):
// - owner: owner_inside_ = true; light_fence(); enters when revoking_ is
//   false and owner_ still names it, else clears owner_inside_ and takes the
//   slow way like any thread.
// - any other thread: takes others_; if owner_ names another thread,
//   revoking_ = true; heavy_fence(); waits until owner_inside_ is false;
//   owner_ = none (revoked); revoking_ goes back to false when it unlocks.
// The fences guarantee the owner sees revoking_ or the other thread sees
// owner_inside_, so never both inside; once owner_ is none, the old owner's
// re-check of owner_ (after its acquire load of revoking_) keeps it out.
// - a bias is given (owner_ = the thread) under others_, to a thread that
//   took the lock `threshold_` times in a row; each revocation multiplies
//   threshold_ by 4, so a lock that changes hands often soon stops being
//   biased and its revocations (a membarrier each, microseconds) stay rare.
// Without membarrier (asymmetric_fences_available) no bias is ever given:
// a test-and-set lock with one more relaxed load.
//
// A thread is named by its thread pointer: unique among live threads; a new
// thread that inherits a dead owner's name inherits the bias, which is as
// good (the dead owner is not inside).
//
// Thread-safety: lock, try_lock and unlock from any thread (a Lockable, not
// recursive). biased_to_calling_thread and revocations read state that the
// lock guards: call them holding it, or with no thread using the lock.
#pragma once

#include <atomic>
#include <cstdint>

#include "alloc/asymmetric_fence.h"
#include "alloc/spin_lock.h"

namespace shoal::alloc::detail {

class biased_lock {
 public:
  [[gnu::always_inline]] void lock() noexcept {
    if (enter_as_owner()) [[likely]] return;
    others_.lock();
    become_exclusive();
  }

  [[nodiscard]] bool try_lock() noexcept {
    if (enter_as_owner()) return true;
    if (!others_.try_lock()) return false;
    return try_become_exclusive();
  }

  [[gnu::always_inline]] void unlock() noexcept {
    if (fast_hold_) [[likely]] {
      fast_hold_ = false;
      owner_inside_.store(false, std::memory_order_release);
      return;
    }
    if (revoking_.load(std::memory_order_relaxed)) revoking_.store(false, std::memory_order_release);
    others_.unlock();
  }

  [[nodiscard]] bool biased_to_calling_thread() const noexcept {
    return owner_.load(std::memory_order_relaxed) == calling_thread();
  }
  [[nodiscard]] std::uint32_t revocations() const noexcept { return revocations_; }

  /// Taken this many times in a row by one thread, an unbiased lock is
  /// biased to it (before any revocation).
  static constexpr std::uint32_t first_threshold = 16;

  /// Tests only: a revocation no longer waits for the owner to leave (the
  /// protection a test shows is needed). Never set outside a test.
  static inline std::atomic<bool> test_skip_waiting_for_owner{false};

 private:
  static std::uintptr_t calling_thread() noexcept {
#if defined(__x86_64__) || defined(__aarch64__)
    return reinterpret_cast<std::uintptr_t>(__builtin_thread_pointer());
#else
    static thread_local char name;
    return reinterpret_cast<std::uintptr_t>(&name);
#endif
  }

  [[gnu::always_inline]] bool enter_as_owner() noexcept {
    const std::uintptr_t me = calling_thread();
    if (owner_.load(std::memory_order_relaxed) != me) return false;
    owner_inside_.store(true, handshake_order);
    light_fence();
    if (!revoking_.load(fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_acquire) &&
        owner_.load(std::memory_order_relaxed) == me) [[likely]] {
      fast_hold_ = true;
      return true;
    }
    owner_inside_.store(false, std::memory_order_release);
    return false;
  }

  // Holding others_: makes the hold exclusive (revokes another thread's bias).
  void become_exclusive() noexcept;
  // Holding others_: as become_exclusive, but gives others_ back and returns
  // false rather than wait for an owner that is inside.
  [[nodiscard]] bool try_become_exclusive() noexcept;
  // Holding others_, revoking_ set and heavy_fence passed, the owner out.
  void revoke(std::uintptr_t me) noexcept;
  // Holding others_, no bias: counts the caller's streak, may bias to it.
  void count_streak(std::uintptr_t me) noexcept;

  // The owner's handshake: its own line, read by the owner on every hold.
  alignas(16) std::atomic<std::uintptr_t> owner_{0};  ///< the biased thread, 0 for none
  std::atomic<bool> owner_inside_{false};            ///< written by the owner only
  std::atomic<bool> revoking_{false};                ///< written under others_ only
  bool fast_hold_ = false;                           ///< the holder took it as owner (guarded by the lock)
  spin_lock others_;
  // Guarded by others_.
  std::uint32_t streak_ = 0;
  std::uint32_t threshold_ = first_threshold;
  std::uint32_t revocations_ = 0;
  std::uintptr_t last_taker_ = 0;
};

}  // namespace shoal::alloc::detail
