// What the biased lock's tests share: skipping where no lock is biased,
// taking a lock often enough to bias it, and turning the revoker's wait for
// the owner off (the protection the tests show is needed).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "alloc/biased_lock.h"

namespace shoal::alloc::detail {

// A macro's work (GTEST_SKIP returns from the test): call it first thing.
inline void skip_without_fences() {
  if (!asymmetric_fences_available()) GTEST_SKIP() << "no membarrier(2) here: the lock is never biased";
}

inline void take_many_times(biased_lock& lock, std::uint32_t times) {
  for (std::uint32_t i = 0; i < times; ++i) {
    lock.lock();
    lock.unlock();
  }
}

// Restores the protection even when an assertion ends the test early.
struct skip_waiting_for_owner {
  skip_waiting_for_owner() { biased_lock::test_skip_waiting_for_owner = true; }
  ~skip_waiting_for_owner() { biased_lock::test_skip_waiting_for_owner = false; }
  skip_waiting_for_owner(const skip_waiting_for_owner&) = delete;
  skip_waiting_for_owner& operator=(const skip_waiting_for_owner&) = delete;
};

}  // namespace shoal::alloc::detail
