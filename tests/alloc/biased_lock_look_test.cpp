// Looks at biased locks (biased_lock::look_at_each, the statistics reader's
// way in): a look waits for an owner inside, revokes no bias, takes many
// locks with one heavy fence, and does not wait on a lock another thread
// holds by the other way before looking at the rest.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "alloc/biased_lock.h"
#include "alloc/biased_lock_helpers.h"

namespace shoal::alloc::detail {
namespace {

using namespace std::chrono_literals;

void bias_to_this_thread(biased_lock& lock) {
  take_many_times(lock, biased_lock::first_threshold);
  ASSERT_TRUE(lock.biased_to_calling_thread());
}

// look_at_each from another thread, as a statistics reader calls it.
template <class Look>
void look_elsewhere(std::vector<biased_lock*> locks, Look look) {
  std::thread([&] { biased_lock::look_at_each(locks, look); }).join();
}

TEST(biased_lock_look, leaves_every_bias_with_its_owner) {
  skip_without_fences();
  std::array<biased_lock, 4> locks;
  for (auto& l : locks) bias_to_this_thread(l);
  std::vector<int> looked(locks.size());
  look_elsewhere({&locks[0], &locks[1], &locks[2], &locks[3]}, [&](std::size_t i) noexcept { ++looked[i]; });
  for (std::size_t i = 0; i < locks.size(); ++i) {
    SCOPED_TRACE("lock " + std::to_string(i));
    EXPECT_EQ(looked[i], 1);
    EXPECT_EQ(locks[i].revocations(), 0U);
    EXPECT_TRUE(locks[i].biased_to_calling_thread());
  }
  // The owner goes on by its fast way: a lock() by another thread would now
  // have revoked (the contrast a look avoids).
  std::thread([&] {
    locks[0].lock();
    locks[0].unlock();
  }).join();
  EXPECT_EQ(locks[0].revocations(), 1U);
}

TEST(biased_lock_look, locks_looked_at_together_share_one_heavy_fence) {
  skip_without_fences();
  std::array<biased_lock, 8> locks;
  std::vector<biased_lock*> all;
  for (auto& l : locks) {
    bias_to_this_thread(l);
    all.push_back(&l);
  }
  const std::uint64_t before = heavy_fences_so_far();
  int looked = 0;
  look_elsewhere(all, [&](std::size_t) noexcept { ++looked; });
  EXPECT_EQ(looked, 8);
  EXPECT_EQ(heavy_fences_so_far() - before, 1U);
  // Unbiased locks need none.
  std::array<biased_lock, 3> plain;
  const std::uint64_t plain_before = heavy_fences_so_far();
  look_elsewhere({&plain[0], &plain[1], &plain[2]}, [&](std::size_t) noexcept { ++looked; });
  EXPECT_EQ(heavy_fences_so_far() - plain_before, 0U);
}

// The owner holds the lock by its fast way while another thread looks.
// Returns whether the look ran while the owner still held it.
bool look_runs_while_owner_holds(biased_lock& lock) {
  bias_to_this_thread(lock);
  std::atomic<bool> looked{false};
  lock.lock();
  std::thread reader([&] {
    std::vector<biased_lock*> one{&lock};
    biased_lock::look_at_each(one, [&](std::size_t) noexcept { looked = true; });
  });
  const auto deadline = std::chrono::steady_clock::now() + 200ms;
  while (!looked && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  const bool looked_while_held = looked;
  lock.unlock();
  reader.join();
  EXPECT_TRUE(looked);
  EXPECT_EQ(lock.revocations(), 0U);
  return looked_while_held;
}

TEST(biased_lock_look, waits_for_the_owner_to_leave) {
  skip_without_fences();
  biased_lock lock;
  EXPECT_FALSE(look_runs_while_owner_holds(lock));
  EXPECT_TRUE(lock.biased_to_calling_thread());
}

TEST(biased_lock_look, without_waiting_for_the_owner_looks_while_it_holds) {
  skip_without_fences();
  if (fences_are_sequential) GTEST_SKIP() << "ThreadSanitizer build: the test makes a data race on purpose";
  biased_lock lock;
  skip_waiting_for_owner off;
  EXPECT_TRUE(look_runs_while_owner_holds(lock));
}

TEST(biased_lock_look, a_lock_held_by_the_other_way_is_looked_at_last_without_holding_the_rest) {
  skip_without_fences();
  biased_lock busy, biased;
  bias_to_this_thread(biased);
  std::atomic<bool> holding{false}, let_go{false};
  std::thread holder([&] {
    busy.lock();  // unbiased: by the other way
    holding = true;
    while (!let_go) std::this_thread::sleep_for(1ms);
    busy.unlock();
  });
  while (!holding) std::this_thread::yield();
  std::atomic<int> looked_biased{0}, looked_busy{0};
  std::thread reader([&] {
    std::vector<biased_lock*> both{&busy, &biased};
    biased_lock::look_at_each(both, [&](std::size_t i) noexcept { ++(i == 0 ? looked_busy : looked_biased); });
  });
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (looked_biased == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(looked_biased, 1);  // not held back by the busy lock
  EXPECT_EQ(looked_busy, 0);
  // Nothing of the reader's holds the biased lock meanwhile: its owner goes in.
  biased.lock();
  biased.unlock();
  let_go = true;
  reader.join();
  holder.join();
  EXPECT_EQ(looked_busy, 1);
  EXPECT_TRUE(biased.biased_to_calling_thread());
}

// Four owners take their own lock in bursts and now and then another's
// (revoking, or holding by the other way), while a reader looks at all four
// again and again, from deterministic random schedules. Inside, each checks
// nobody else is; the look checks the same and reads what the lock guards.
TEST(biased_lock_look, random_schedules_never_let_a_look_in_beside_a_holder) {
  const int rounds = std::getenv("SHOAL_TEST_STRESS_OPERATIONS") != nullptr ? 10 : 60;
  constexpr int owners = 4;
  int overlaps_seen = 0;
  std::int64_t looks = 0;
  for (unsigned seed : {1U, 2U, 3U}) {
    for (int round = 0; round < rounds; ++round) {
      std::array<biased_lock, owners> locks;
      std::array<std::atomic<bool>, owners> inside{};
      std::array<std::int64_t, owners> counted{};  // each guarded by its lock
      std::atomic<int> overlaps{0};
      std::atomic<int> running{owners};
      const auto enter = [&](int i) {
        if (inside[i].exchange(true)) ++overlaps;
      };
      std::vector<std::thread> threads;
      for (int t = 0; t < owners; ++t) {
        threads.emplace_back([&, t] {
          std::mt19937 rng(seed * 104729 + static_cast<unsigned>(round * owners + t));
          std::uniform_int_distribution<int> percent(0, 99);
          for (int burst = 0; burst < 30; ++burst) {
            const int which = percent(rng) < 85 ? t : percent(rng) % owners;
            for (int n = 1 + percent(rng) % 24; n > 0; --n) {
              locks[which].lock();
              enter(which);
              ++counted[which];
              for (int spin = percent(rng) % 16; spin > 0; --spin) std::atomic_signal_fence(std::memory_order_seq_cst);
              inside[which] = false;
              locks[which].unlock();
            }
            if (percent(rng) < 5) std::this_thread::yield();
          }
          --running;
        });
      }
      threads.emplace_back([&] {
        std::mt19937 rng(seed * 7 + static_cast<unsigned>(round));
        std::vector<biased_lock*> all;
        for (auto& l : locks) all.push_back(&l);
        std::int64_t last_sum = 0;
        while (running > 0) {
          std::int64_t sum = 0;
          biased_lock::look_at_each(all, [&](std::size_t i) noexcept {
            enter(static_cast<int>(i));
            sum += counted[i];
            inside[i] = false;
          });
          if (sum < last_sum) ++overlaps;  // counts only grow
          last_sum = sum;
          ++looks;
          if (rng() % 4 == 0) std::this_thread::yield();
        }
      });
      for (auto& th : threads) th.join();
      overlaps_seen += overlaps;
    }
  }
  EXPECT_EQ(overlaps_seen, 0);
  EXPECT_GT(looks, 0);
}

}  // namespace
}  // namespace shoal::alloc::detail
