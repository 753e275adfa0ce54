// Checks an allocator's invariants over and over on the calling thread while
// another thread changes it (tests of what a concurrent check may see).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <functional>
#include <thread>

#include "shoal/alloc/caching_allocator.h"

namespace shoal::testing {

/// Runs `churn` on a thread of its own and check_invariants here until it
/// ends (at least once). A broken invariant fails the test with its message;
/// a throw from `churn` is rethrown here after the join, not left to
/// std::terminate.
inline void expect_invariants_hold_during(alloc::caching_allocator& a, const std::function<void()>& churn) {
  std::atomic<bool> done{false};
  std::exception_ptr churn_error;
  std::thread worker([&] {
    try {
      churn();
    } catch (...) {
      churn_error = std::current_exception();
    }
    done = true;
  });
  int checks = 0;
  while (!done || checks == 0) {
    try {
      a.check_invariants();
    } catch (const std::exception& e) {
      worker.join();  // the churn ends by itself
      FAIL() << "check " << checks << ": " << e.what();
    }
    ++checks;
  }
  worker.join();
  if (churn_error) std::rethrow_exception(churn_error);
  EXPECT_NO_THROW(a.check_invariants());
}

}  // namespace shoal::testing
