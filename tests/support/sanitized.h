// Whether this test program is built with a sanitizer (ASan+UBSan or TSan:
// SHOAL_SANITIZE, scripts/test's "address" and "thread" builds), and a count
// of rounds cut down there.
//
// Those builds run the same code 10-50x slower (the instrumentation, and the
// allocator checking its invariants after every step: SHOAL_CHECK_INVARIANTS
// is on by default with a sanitizer), and CI runs each on 2 cores. A test
// whose rounds repeat one race or one kind of schedule many times runs fewer
// rounds there, still enough to exercise it; the normal build keeps the full
// count. Tests that say so in a comment where they call this.
// (SHOAL_TEST_STRESS_OPERATIONS, set by scripts/test for instrumented builds,
// is the older way a few stress tests take their count.)
#pragma once

namespace shoal::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)  // GCC
inline constexpr bool sanitized_build = true;
#elif defined(__has_feature)  // clang
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool sanitized_build = true;
#else
inline constexpr bool sanitized_build = false;
#endif
#else
inline constexpr bool sanitized_build = false;
#endif

/// `full` in the normal build; `full / divisor` (at least 1) in a sanitized one.
constexpr int fewer_when_sanitized(int full, int divisor) {
  if (!sanitized_build) return full;
  return full / divisor > 0 ? full / divisor : 1;
}

}  // namespace shoal::testing
