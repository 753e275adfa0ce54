// Waits in tests that must end: a call that hangs becomes a test failure.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <future>

namespace shoal::testing {

/// Runs `call` on another thread. When it has not returned within `limit`,
/// `unblock()` makes it return and the test fails: a hang becomes a failure.
template <class Call, class Unblock>
void returns_within(std::chrono::milliseconds limit, Call call, Unblock unblock) {
  auto done = std::async(std::launch::async, call);
  if (done.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << "the call did not return within " << limit.count() << " ms";
    unblock();
  }
  done.get();
}

}  // namespace shoal::testing
