#include "alloc/biased_lock.h"

#include <algorithm>
#include <thread>

namespace shoal::alloc::detail {

namespace {

constexpr std::uint32_t last_threshold = std::uint32_t{1} << 20;

// After revoking_ is set and the heavy fence passed: the owner cannot enter
// by its fast way any more, so only one already inside is waited for.
void wait_for_owner_to_leave(const std::atomic<bool>& owner_inside) noexcept {
  if (biased_lock::test_skip_waiting_for_owner.load(std::memory_order_relaxed)) return;
  for (int spins = 0; owner_inside.load(fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_acquire);
       ++spins) {
    if (spins > 64) std::this_thread::yield();
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace

void biased_lock::become_exclusive() noexcept {
  const std::uintptr_t me = calling_thread();
  const std::uintptr_t owner = owner_.load(std::memory_order_relaxed);
  if (owner == 0) return count_streak(me);
  // My own bias (my fast way saw a revoking_ that gave up since): nobody
  // else enters by the fast way, and others_ keeps the rest out.
  if (owner == me) return;
  revoking_.store(true, handshake_order);
  heavy_fence();
  wait_for_owner_to_leave(owner_inside_);
  revoke(me);
}

bool biased_lock::try_become_exclusive() noexcept {
  const std::uintptr_t me = calling_thread();
  const std::uintptr_t owner = owner_.load(std::memory_order_relaxed);
  if (owner == 0) {
    count_streak(me);
    return true;
  }
  if (owner == me) return true;
  revoking_.store(true, handshake_order);
  heavy_fence();
  if (owner_inside_.load(fences_are_sequential ? std::memory_order_seq_cst : std::memory_order_acquire) &&
      !test_skip_waiting_for_owner.load(std::memory_order_relaxed)) {
    // Not unlock(): fast_hold_ is the owner's, inside now. The bias stays.
    revoking_.store(false, std::memory_order_release);
    others_.unlock();
    return false;
  }
  revoke(me);
  return true;
}

void biased_lock::revoke(std::uintptr_t me) noexcept {
  owner_.store(0, std::memory_order_relaxed);
  ++revocations_;
  threshold_ = std::min(threshold_ * 4, last_threshold);
  last_taker_ = me;
  streak_ = 1;
}

void biased_lock::count_streak(std::uintptr_t me) noexcept {
  if (me != last_taker_) {
    last_taker_ = me;
    streak_ = 1;
    return;
  }
  if (++streak_ >= threshold_ && asymmetric_fences_available()) owner_.store(me, std::memory_order_relaxed);
}

}  // namespace shoal::alloc::detail
