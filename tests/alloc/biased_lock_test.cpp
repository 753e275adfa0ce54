// The pools' biased lock: the bias goes to a thread that keeps taking it, is
// revoked by another thread without ever letting two threads in, and the
// revocation's wait for the owner is what keeps them apart.
#include "alloc/biased_lock.h"

#include <gtest/gtest.h>

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <memory>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "alloc/biased_lock_helpers.h"
#include "support/processes.h"

namespace shoal::alloc::detail {
namespace {

using namespace std::chrono_literals;


TEST(biased_lock, is_biased_to_a_thread_that_keeps_taking_it) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold - 1);
  EXPECT_FALSE(lock.biased_to_calling_thread());
  take_many_times(lock, 1);
  EXPECT_TRUE(lock.biased_to_calling_thread());
  EXPECT_EQ(lock.revocations(), 0U);
}

// Another thread takes the lock once (revoking a bias the caller had).
void taken_once_elsewhere(biased_lock& lock) {
  bool other_was_biased = true;
  std::thread([&] {
    take_many_times(lock, 1);
    other_was_biased = lock.biased_to_calling_thread();
  }).join();
  EXPECT_FALSE(other_was_biased);
}

// Takes the lock until it is biased to the caller; how many times it took.
std::uint32_t takes_to_earn_the_bias(biased_lock& lock) {
  std::uint32_t n = 0;
  while (!lock.biased_to_calling_thread() && n < (1U << 21)) {
    take_many_times(lock, 1);
    ++n;
  }
  return n;
}

// Whether another thread's try_lock succeeds (it unlocks at once).
bool try_lock_elsewhere(biased_lock& lock) {
  bool got = false;
  std::thread([&] {
    got = lock.try_lock();
    if (got) lock.unlock();
  }).join();
  return got;
}

TEST(biased_lock, revocations_close_together_make_the_next_bias_four_times_longer_to_earn) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold);
  ASSERT_TRUE(lock.biased_to_calling_thread());
  const auto first = std::chrono::steady_clock::now();
  taken_once_elsewhere(lock);
  EXPECT_EQ(lock.revocations(), 1U);
  EXPECT_FALSE(lock.biased_to_calling_thread());
  // The first revocation in a while: the streak stays as short.
  EXPECT_EQ(takes_to_earn_the_bias(lock), biased_lock::first_threshold);
  taken_once_elsewhere(lock);
  const bool close_together = std::chrono::steady_clock::now() - first < biased_lock::quiet_interval;
  EXPECT_EQ(lock.revocations(), 2U);
  const std::uint32_t second = takes_to_earn_the_bias(lock);
  if (!close_together) GTEST_SKIP() << "the two revocations were further apart than the quiet interval here";
  EXPECT_EQ(second, 4 * biased_lock::first_threshold);
}

TEST(biased_lock, a_revocation_after_a_quiet_interval_starts_the_streak_over) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold);
  for (int i = 0; i < 3; ++i) {  // three revocations close together: 16, 64, 256
    taken_once_elsewhere(lock);
    (void)takes_to_earn_the_bias(lock);
  }
  ASSERT_EQ(lock.revocations(), 3U);
  std::this_thread::sleep_for(biased_lock::quiet_interval + 20ms);
  taken_once_elsewhere(lock);
  EXPECT_EQ(takes_to_earn_the_bias(lock), biased_lock::first_threshold);
}

TEST(biased_lock, after_a_quiet_interval_a_short_streak_earns_the_bias_without_a_revocation) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold);
  for (int i = 0; i < 2; ++i) {  // revocations close together: the streak grows to 64
    taken_once_elsewhere(lock);
    (void)takes_to_earn_the_bias(lock);
  }
  taken_once_elsewhere(lock);  // the third: 256, and nobody biased now
  ASSERT_EQ(lock.revocations(), 3U);
  std::this_thread::sleep_for(biased_lock::quiet_interval + 20ms);
  EXPECT_EQ(takes_to_earn_the_bias(lock), biased_lock::first_threshold);
  EXPECT_EQ(lock.revocations(), 3U);
}

TEST(biased_lock, a_thread_inside_one_lock_by_its_fast_way_holds_a_second_by_the_other) {
  skip_without_fences();
  biased_lock first, second;
  take_many_times(first, biased_lock::first_threshold);
  take_many_times(second, biased_lock::first_threshold);
  ASSERT_TRUE(first.biased_to_calling_thread());
  ASSERT_TRUE(second.biased_to_calling_thread());
  first.lock();
  second.lock();  // the record's one slot is taken: through others_
  EXPECT_FALSE(try_lock_elsewhere(first));
  EXPECT_FALSE(try_lock_elsewhere(second));
  second.unlock();
  EXPECT_FALSE(try_lock_elsewhere(first));
  first.unlock();
  EXPECT_EQ(first.revocations(), 0U);
  EXPECT_EQ(second.revocations(), 0U);
  EXPECT_TRUE(try_lock_elsewhere(second));  // revokes
  EXPECT_TRUE(try_lock_elsewhere(first));
  EXPECT_EQ(first.revocations() + second.revocations(), 2U);
}

TEST(biased_lock, a_bias_of_a_thread_that_ended_is_revoked_or_taken_over_safely) {
  skip_without_fences();
  biased_lock orphaned, other;
  std::thread([&] {
    take_many_times(orphaned, biased_lock::first_threshold);
    EXPECT_TRUE(orphaned.biased_to_calling_thread());
  }).join();
  // The next thread to need a record takes the ended one's (the last
  // handed back), and with it the bias.
  bool took_over = false;
  bool main_got_in_while_held = true;
  std::thread([&] {
    take_many_times(other, biased_lock::first_threshold);
    took_over = orphaned.biased_to_calling_thread();
    if (!took_over) return;
    orphaned.lock();  // by the fast way
    main_got_in_while_held = try_lock_elsewhere(orphaned);
    orphaned.unlock();
  }).join();
  if (took_over) EXPECT_FALSE(main_got_in_while_held);
  // Whoever has it now, this thread takes it by revoking.
  orphaned.lock();
  orphaned.unlock();
  EXPECT_EQ(orphaned.revocations(), 1U);
  if (!took_over) GTEST_SKIP() << "another thread's record was handed on first; revocation checked only";
}

TEST(biased_lock, a_record_whose_thread_ended_holding_a_lock_by_the_other_way_is_not_handed_on) {
  // The lock its thread ended holding must stay held: handed on, the record
  // would give the next thread that lock's bias, and its fast way in beside
  // the hold. (A thread ending inside a pool lock is a bug in the library;
  // the lock still behaves as a test-and-set lock would.)
  skip_without_fences();
  biased_lock first, held;
  std::thread([&] {
    take_many_times(first, biased_lock::first_threshold);
    take_many_times(held, biased_lock::first_threshold);
    ASSERT_TRUE(first.biased_to_calling_thread());
    ASSERT_TRUE(held.biased_to_calling_thread());
    first.lock();  // by the fast way: the record's one slot
    held.lock();   // by the other way
    first.unlock();
  }).join();
  // The next thread to need a record would take the ended one's, the last
  // handed back (a_bias_of_a_thread_that_ended_is_revoked_or_taken_over_safely).
  bool inherited = true;
  std::thread([&] {
    biased_lock other;
    take_many_times(other, biased_lock::first_threshold);
    ASSERT_TRUE(other.biased_to_calling_thread());
    inherited = held.biased_to_calling_thread();
  }).join();
  EXPECT_FALSE(inherited) << "the ended thread's record, still holding a lock, was handed on";
}

TEST(biased_lock, a_fork_child_takes_a_lock_biased_to_a_thread_it_does_not_have) {
  skip_without_fences();
  if (!testing::forked_child_may_start_threads) GTEST_SKIP() << "sanitizers: a fork child starts no threads here";
  biased_lock lock;
  std::atomic<bool> biased{false}, done{false};
  std::thread owner([&] {
    take_many_times(lock, biased_lock::first_threshold);
    biased = true;
    while (!done) std::this_thread::sleep_for(1ms);
  });
  while (!biased) std::this_thread::yield();
  testing::forked_child child([&] {
    lock.lock();  // revokes the owner's bias: it is not in this process
    lock.unlock();
    biased_lock fresh;  // and a record for this child's own bias
    take_many_times(fresh, biased_lock::first_threshold);
    return lock.revocations() == 1 && fresh.biased_to_calling_thread() ? 0 : 1;
  });
  EXPECT_EQ(child.wait(), 0);
  done = true;
  owner.join();
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
  EXPECT_FALSE(try_lock_elsewhere(lock));
  EXPECT_EQ(lock.revocations(), 0U);
  EXPECT_TRUE(lock.biased_to_calling_thread());
  lock.unlock();
  EXPECT_TRUE(try_lock_elsewhere(lock));
  EXPECT_EQ(lock.revocations(), 1U);
}

TEST(biased_lock, try_lock_by_the_owner_takes_its_fast_way) {
  skip_without_fences();
  biased_lock lock;
  take_many_times(lock, biased_lock::first_threshold);
  ASSERT_TRUE(lock.try_lock());
  const bool other_got = try_lock_elsewhere(lock);
  lock.unlock();
  EXPECT_FALSE(other_got);
  EXPECT_TRUE(lock.biased_to_calling_thread());
}

// A thread that lost its bias while about to use it (stopped between its
// look at owner_ and its store, here by a signal whose handler waits) must
// not disturb the thread that earned the bias meanwhile: it may clear only
// its own record. Before records were per thread, it cleared the new
// owner's flag, and a third taker walked in beside the new owner.
std::atomic<int> stale_phase{0};  // 1: the old owner is stopped; 2: the new owner is inside; 3: done

void wait_in_handler(int) {
  stale_phase.store(1);
  const auto until = std::chrono::steady_clock::now() + 3ms;
  while (stale_phase.load() < 2 && std::chrono::steady_clock::now() < until) {
  }
}

TEST(biased_lock, an_owner_that_lost_its_bias_midway_leaves_the_new_owner_alone) {
  skip_without_fences();
  // ThreadSanitizer holds signals back until a safe point, so the stop
  // never lands between the two steps there.
  if (fences_are_sequential) GTEST_SKIP() << "ThreadSanitizer build: signals are delivered late";
  struct sigaction action {};
  action.sa_handler = wait_in_handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  struct sigaction previous {};
  ASSERT_EQ(sigaction(SIGUSR1, &action, &previous), 0);
  std::mt19937 rng(1);
  std::atomic<int> overlaps{0};
  int new_owner_held = 0;
  for (int round = 0; round < 300 && overlaps == 0; ++round) {
    auto lock = std::make_unique<biased_lock>();
    std::atomic<int> inside{0};
    std::atomic<bool> old_owner_ready{false}, stop{false};
    stale_phase = 0;
    const auto enter = [&](int who) {
      if (inside.exchange(who) != 0) ++overlaps;
    };
    std::thread old_owner([&] {
      take_many_times(*lock, biased_lock::first_threshold);
      old_owner_ready = true;
      while (!stop.load(std::memory_order_relaxed)) {
        lock->lock();
        enter(1);
        inside = 0;
        lock->unlock();
      }
    });
    std::thread new_owner([&] {
      while (stale_phase.load() < 1) std::this_thread::yield();
      if (takes_to_earn_the_bias(*lock) < (1U << 21)) {
        lock->lock();  // by the fast way
        enter(2);
        stale_phase.store(2);
        const auto until = std::chrono::steady_clock::now() + 2ms;
        while (std::chrono::steady_clock::now() < until) {
        }
        inside = 0;
        lock->unlock();
        ++new_owner_held;
      }
      stale_phase.store(3);
    });
    while (!old_owner_ready) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(20 + rng() % 200));
    pthread_kill(old_owner.native_handle(), SIGUSR1);
    const auto until = std::chrono::steady_clock::now() + 200ms;
    while (stale_phase.load() < 3 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(50us);
    stop = true;
    old_owner.join();
    new_owner.join();
  }
  sigaction(SIGUSR1, &previous, nullptr);
  EXPECT_EQ(overlaps, 0);
  EXPECT_GT(new_owner_held, 0);
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
  std::int64_t revocations = 0;
};

stress_result run_schedule(unsigned seed, int rounds, int bursts_per_round) {
  constexpr int threads = 4;
  stress_result r;
  for (int round = 0; round < rounds; ++round) {
    // A fresh lock each round: its streak lengths start short, so biases
    // are given and revoked all through the schedule.
    biased_lock lock;
    std::atomic<bool> someone_inside{false};
    std::atomic<int> overlaps{0};
    std::int64_t counted = 0;  // guarded by lock
    std::vector<std::int64_t> entries(threads), as_owner(threads);
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        std::mt19937 rng(seed * 7919 + static_cast<unsigned>(round * threads + t));
        std::uniform_int_distribution<int> percent(0, 99);
        for (int burst = 0; burst < bursts_per_round; ++burst) {
          const int length = percent(rng) < 20 ? 16 + percent(rng) * 2 : 1 + percent(rng) % 4;
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
    r.counted += counted;
    r.overlaps += overlaps;
    r.revocations += lock.revocations();
    for (int t = 0; t < threads; ++t) {
      r.entries += entries[t];
      r.entries_as_owner += as_owner[t];
    }
  }
  return r;
}

// A misuse of the lock (a bug in the library's own locking) ends a checking
// build with a message: run in a child, which ends by SIGABRT. Without the
// checks the child would hang (a recursive hold by the other way) or go on.
void expect_misuse_ends_the_process(bool bias_first, const std::function<void(biased_lock&)>& misuse) {
  if (!biased_lock::checks_misuse()) GTEST_SKIP() << "this build does not check the lock's use (Release)";
  if (bias_first && !asymmetric_fences_available()) GTEST_SKIP() << "no membarrier(2) here: the lock is never biased";
  testing::forked_child child([&] {
    biased_lock lock;
    if (bias_first) take_many_times(lock, biased_lock::first_threshold);
    if (lock.biased_to_calling_thread() != bias_first) return 2;
    misuse(lock);
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the misuse hung";
  EXPECT_EQ(*status, 128 + SIGABRT);
}

TEST(biased_lock, a_thread_taking_a_lock_it_holds_by_its_fast_way_is_caught) {
  expect_misuse_ends_the_process(true, [](biased_lock& lock) {
    lock.lock();
    lock.lock();
  });
}

TEST(biased_lock, a_thread_taking_a_lock_it_holds_by_the_other_way_is_caught) {
  expect_misuse_ends_the_process(false, [](biased_lock& lock) {
    lock.lock();
    lock.lock();
  });
}

// The take that earns the bias holds the lock by the other way: a second
// take would find the fast way open but for the record's mark.
TEST(biased_lock, a_thread_taking_again_the_lock_whose_bias_its_hold_earned_is_caught) {
  skip_without_fences();
  expect_misuse_ends_the_process(false, [](biased_lock& lock) {
    take_many_times(lock, biased_lock::first_threshold - 1);
    lock.lock();  // the streak's last take: biased to this thread now, held by the other way
    if (!lock.biased_to_calling_thread()) std::_Exit(3);
    lock.lock();
  });
}

TEST(biased_lock, try_lock_of_a_lock_held_by_the_fast_way_is_caught) {
  expect_misuse_ends_the_process(true, [](biased_lock& lock) {
    lock.lock();
    (void)lock.try_lock();
  });
}

TEST(biased_lock, try_lock_of_a_lock_held_by_the_other_way_is_caught) {
  expect_misuse_ends_the_process(false, [](biased_lock& lock) {
    lock.lock();
    (void)lock.try_lock();
  });
}

TEST(biased_lock, a_second_unlock_is_caught) {
  for (const bool biased : {true, false}) {
    SCOPED_TRACE(biased ? "biased" : "unbiased");
    expect_misuse_ends_the_process(biased, [](biased_lock& lock) {
      lock.lock();
      lock.unlock();
      lock.unlock();
    });
  }
}

TEST(biased_lock, an_unlock_by_a_thread_that_does_not_hold_it_is_caught) {
  if (!testing::forked_child_may_start_threads) GTEST_SKIP() << "sanitizers: a fork child starts no threads here";
  expect_misuse_ends_the_process(false, [](biased_lock& lock) {
    lock.lock();
    std::thread([&] { lock.unlock(); }).join();
  });
}

TEST(biased_lock, random_schedules_never_let_two_threads_in) {
  // Instrumented builds (scripts/test sets SHOAL_TEST_STRESS_OPERATIONS) run
  // a tenth of the rounds.
  const int rounds = std::getenv("SHOAL_TEST_STRESS_OPERATIONS") != nullptr ? 20 : 200;
  std::int64_t as_owner = 0, revocations = 0;
  for (unsigned seed : {1U, 2U, 3U}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const stress_result r = run_schedule(seed, rounds, 40);
    EXPECT_EQ(r.overlaps, 0);
    EXPECT_EQ(r.counted, r.entries);
    as_owner += r.entries_as_owner;
    revocations += r.revocations;
  }
  // Biases were given and revoked all along (where the lock can be biased).
  if (asymmetric_fences_available()) {
    EXPECT_GT(as_owner, 0);
    EXPECT_GE(revocations, rounds);
  }
}

}  // namespace
}  // namespace shoal::alloc::detail
