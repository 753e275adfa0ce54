// Waiting by watching: a thread that expects the next piece of work within
// microseconds checks for it in a loop for a short window before it sleeps.
// Waking a sleeping thread costs several microseconds, more than a small
// batch's whole copy, so handing batches between threads that sleep each
// time caps small batches far below the link.
//
// Thread-safety: none needed (no state).
#pragma once

#include <chrono>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace shoal::transfer {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

/// Checks `ready` until it holds or `window` has passed; returns its last value.
template <class Ready>
bool spin_for(std::chrono::microseconds window, Ready ready) {
  const auto until = std::chrono::steady_clock::now() + window;
  for (;;) {
    if (ready()) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    for (int i = 0; i < 32; ++i) cpu_relax();
  }
}

}  // namespace shoal::transfer
