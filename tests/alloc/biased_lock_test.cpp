// The pools' biased lock: the bias goes to a thread that keeps taking it, is
// revoked by another thread without ever letting two threads in, and the
// revocation's wait for the owner is what keeps them apart.
#include "alloc/biased_lock.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace shoal::alloc::detail {
namespace {

using namespace std::chrono_literals;

void skip_without_fences() {
  if (!asymmetric_fences_available()) GTEST_SKIP() << "no membarrier(2) here: the lock is never biased";
}

void take_many_times(biased_lock& lock, std::uint32_t times) {
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

TEST(biased_lock, is_biased_to_a_thread_that_keeps_taking_it) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold - 1);
  EXPECT_FALSE(lock.biased_to_calling_thread());
  take_many_times(lock, 1);
  EXPECT_TRUE(lock.biased_to_calling_thread());
  EXPECT_EQ(lock.revocations(), 0U);
}

TEST(biased_lock, another_thread_revokes_the_bias_and_the_next_takes_four_times_longer) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold);
  ASSERT_TRUE(lock.biased_to_calling_thread());
  bool other_was_biased = true;
  std::thread([&] {
    take_many_times(lock, 1);
    other_was_biased = lock.biased_to_calling_thread();
  }).join();
  EXPECT_FALSE(other_was_biased);
  EXPECT_EQ(lock.revocations(), 1U);
  EXPECT_FALSE(lock.biased_to_calling_thread());
  take_many_times(lock, 4 * biased_lock::first_threshold - 1);
  EXPECT_FALSE(lock.biased_to_calling_thread());
  take_many_times(lock, 1);
  EXPECT_TRUE(lock.biased_to_calling_thread());
}

// The owner holds the lock by its fast way; another thread asks for it.
// Returns whether that thread got in while the owner still held it.
bool other_thread_enters_while_owner_holds(biased_lock& lock) {
  take_many_times(lock, biased_lock::first_threshold);
  EXPECT_TRUE(lock.biased_to_calling_thread());
  std::atomic<bool> entered{false};
  lock.lock();
  std::thread other([&] {
    lock.lock();
    entered = true;
    lock.unlock();
  });
  const auto deadline = std::chrono::steady_clock::now() + 200ms;
  while (!entered && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  const bool entered_while_held = entered;
  lock.unlock();
  other.join();
  EXPECT_TRUE(entered);
  return entered_while_held;
}

TEST(biased_lock, a_revoking_thread_waits_for_the_owner_to_leave) {
  skip_without_fences();
  biased_lock lock;
  EXPECT_FALSE(other_thread_enters_while_owner_holds(lock));
  EXPECT_EQ(lock.revocations(), 1U);
}

TEST(biased_lock, without_waiting_for_the_owner_two_threads_are_inside) {
  skip_without_fences();
  // The race this makes on purpose is one ThreadSanitizer reports.
  if (fences_are_sequential) GTEST_SKIP() << "ThreadSanitizer build: the test makes a data race on purpose";
  biased_lock lock;
  skip_waiting_for_owner off;
  EXPECT_TRUE(other_thread_enters_while_owner_holds(lock));
}

TEST(biased_lock, try_lock_fails_while_the_owner_is_inside_and_keeps_the_bias) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold);
  lock.lock();
  bool got = true;
  std::thread([&] {
    got = lock.try_lock();
    if (got) lock.unlock();
  }).join();
  EXPECT_FALSE(got);
  EXPECT_EQ(lock.revocations(), 0U);
  EXPECT_TRUE(lock.biased_to_calling_thread());
  lock.unlock();
  std::thread([&] {
    got = lock.try_lock();
    if (got) lock.unlock();
  }).join();
  EXPECT_TRUE(got);
  EXPECT_EQ(lock.revocations(), 1U);
}

TEST(biased_lock, try_lock_by_the_owner_takes_its_fast_way) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold);
  ASSERT_TRUE(lock.try_lock());
  bool other_got = true;
  std::thread([&] {
    other_got = lock.try_lock();
    if (other_got) lock.unlock();
  }).join();
  lock.unlock();
  EXPECT_FALSE(other_got);
  EXPECT_TRUE(lock.biased_to_calling_thread());
}

// Threads take the lock in bursts of random length (long ones earn a bias,
// short ones from others revoke it), by lock() and by try_lock(), from
// deterministic random schedules. Inside, each checks nobody else is, and
// bumps a counter the lock alone guards.
struct stress_result {
  std::int64_t counted = 0;
  std::int64_t entries = 0;
  int overlaps = 0;
  std::int64_t entries_as_owner = 0;
};

stress_result run_schedule(unsigned seed, int bursts_per_thread) {
  constexpr int threads = 4;
  biased_lock lock;
  std::atomic<bool> someone_inside{false};
  std::atomic<int> overlaps{0};
  std::int64_t counted = 0;  // guarded by lock
  std::vector<std::int64_t> entries(threads), as_owner(threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(seed * 97 + static_cast<unsigned>(t));
      std::uniform_int_distribution<int> percent(0, 99);
      for (int burst = 0; burst < bursts_per_thread; ++burst) {
        const int length = percent(rng) < 10 ? 50 + percent(rng) * 4 : 1 + percent(rng) % 4;
        for (int i = 0; i < length; ++i) {
          if (percent(rng) < 10) {
            if (!lock.try_lock()) continue;
          } else {
            lock.lock();
          }
          if (someone_inside.exchange(true)) ++overlaps;
          ++counted;
          ++entries[t];
          if (lock.biased_to_calling_thread()) ++as_owner[t];
          for (int spin = percent(rng) % 16; spin > 0; --spin) std::atomic_signal_fence(std::memory_order_seq_cst);
          someone_inside = false;
          lock.unlock();
        }
        if (percent(rng) < 5) std::this_thread::yield();
      }
    });
  }
  for (auto& w : workers) w.join();
  stress_result r;
  r.counted = counted;
  r.overlaps = overlaps;
  for (int t = 0; t < threads; ++t) {
    r.entries += entries[t];
    r.entries_as_owner += as_owner[t];
  }
  return r;
}

TEST(biased_lock, random_schedules_never_let_two_threads_in) {
  // Instrumented builds (scripts/test sets SHOAL_TEST_STRESS_OPERATIONS) run
  // a tenth of the bursts.
  const int bursts = std::getenv("SHOAL_TEST_STRESS_OPERATIONS") != nullptr ? 400 : 4000;
  std::int64_t as_owner = 0;
  for (unsigned seed : {1U, 2U, 3U}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const stress_result r = run_schedule(seed, bursts);
    EXPECT_EQ(r.overlaps, 0);
    EXPECT_EQ(r.counted, r.entries);
    as_owner += r.entries_as_owner;
  }
  // Biases were given on the way (where the lock can be biased).
  if (asymmetric_fences_available()) EXPECT_GT(as_owner, 0);
}

}  // namespace
}  // namespace shoal::alloc::detail
