// The staging copy split across helper threads: every byte lands once, for
// sizes that do and do not divide into slices, with either kind of store,
// back to back and after the helpers have gone to sleep.
#include "transfer/parallel_memcpy.h"

#include "shoal/core/error.h"
#include "support/refused_threads.h"
#include "support/sanitized.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace shoal::transfer {
namespace {

TEST(parallel_memcpy, every_byte_arrives_for_sizes_that_do_and_do_not_split_evenly) {
  for (store_kind stores : {store_kind::cached, store_kind::streaming, store_kind::automatic}) {
    for (std::size_t helpers : {0u, 1u, 3u, 9u}) {
      parallel_memcpy copier(helpers);
      for (std::size_t bytes : {std::size_t{1}, std::size_t{4096}, std::size_t{256} << 10, (std::size_t{1} << 20) + 7,
                                (std::size_t{8} << 20) + 4093}) {
        std::vector<std::uint8_t> src(bytes), dst(bytes, 0);
        std::iota(src.begin(), src.end(), static_cast<std::uint8_t>(bytes + helpers));
        copier.copy(dst.data(), src.data(), bytes, stores);
        EXPECT_EQ(dst, src) << bytes << " bytes with " << helpers << " helpers, stores "
                            << static_cast<int>(stores);
      }
    }
  }
}

TEST(parallel_memcpy, many_copies_back_to_back_each_complete_before_copy_returns) {
  parallel_memcpy copier(3);
  std::vector<std::uint8_t> src(3 << 20), dst(3 << 20);
  for (int round = 0; round < 200; ++round) {
    std::fill(src.begin(), src.end(), static_cast<std::uint8_t>(round));
    copier.copy(dst.data(), src.data(), src.size(), round % 2 == 0 ? store_kind::cached : store_kind::streaming);
    ASSERT_EQ(dst.front(), static_cast<std::uint8_t>(round));
    ASSERT_EQ(dst.back(), static_cast<std::uint8_t>(round));
    ASSERT_EQ(dst[dst.size() / 2 + 1], static_cast<std::uint8_t>(round));
  }
}

// Helpers that watched past their spin window sleep; the next copy wakes
// them. Every byte arrives after the helpers slept, and the helpers take
// slices of those copies: a lost wake-up would leave the caller copying every
// slice alone, which the bytes alone cannot show. (One slice is a few
// milliseconds of copying here, far longer than a wake-up even on a loaded
// machine; over five copies, helpers that wake take at least one.)
TEST(parallel_memcpy, a_copy_after_the_helpers_fell_asleep_wakes_them_and_completes_with_every_byte) {
  parallel_memcpy copier(3);
  std::vector<std::uint8_t> src(64 << 20), dst(64 << 20);
  std::uint64_t taken = 0;
  for (int round = 0; round < 5; ++round) {
    std::this_thread::sleep_for(parallel_memcpy::spin_window * 5);
    std::fill(src.begin(), src.end(), static_cast<std::uint8_t>(round + 1));
    const std::uint64_t before = copier.slices_copied_by_helpers();
    copier.copy(dst.data(), src.data(), src.size(), store_kind::streaming);
    taken += copier.slices_copied_by_helpers() - before;
    ASSERT_EQ(dst, src) << "round " << round;
  }
  EXPECT_GT(taken, 0U) << "no helper woke for a copy made after they slept";
}

// A list of copies split by bytes as if they were one: slices begin and end
// inside copies and span several (empty copies among them), on all threads
// or on a few, and every copy lands whole, with nothing written outside it
// (the gaps around destinations keep their bytes).
TEST(parallel_memcpy, a_list_of_copies_lands_whole_with_slices_across_and_within_copies) {
  std::mt19937 random(17);
  // Sanitized builds run the first 8 rounds of each case (28 s under TSan for
  // 20): they still take both size ranges and every cap on the threads
  // (SIZE_MAX, 1, 2, 3 and 4), with 1-40 copies each.
  const int rounds = shoal::testing::sanitized_build ? 8 : 20;
  for (store_kind stores : {store_kind::cached, store_kind::streaming, store_kind::automatic}) {
    for (std::size_t helpers : {0u, 1u, 3u, 9u}) {
      parallel_memcpy copier(helpers);
      for (int round = 0; round < rounds; ++round) {
        const std::size_t count = 1 + random() % 40;
        std::vector<std::size_t> sizes(count);
        for (auto& n : sizes) n = random() % 7 == 0 ? 0 : 1 + random() % (round % 2 == 0 ? (96u << 10) : (700u << 10));
        const std::size_t gap = 64;
        std::size_t total = gap;
        for (std::size_t n : sizes) total += n + gap;
        std::vector<std::uint8_t> src(total), dst(total, 0xEE);
        std::iota(src.begin(), src.end(), static_cast<std::uint8_t>(round));
        std::vector<copy_job> jobs;
        std::size_t at = gap;
        for (std::size_t n : sizes) {
          jobs.push_back({reinterpret_cast<std::byte*>(dst.data() + at), reinterpret_cast<const std::byte*>(src.data() + at), n});
          at += n + gap;
        }
        const std::size_t max_threads = round % 3 == 0 ? SIZE_MAX : 1 + round % 4;  // also capped below the helpers
        copier.copy_all(jobs, stores, max_threads);
        at = 0;
        for (std::size_t n : sizes) {
          for (std::size_t k = at; k < at + gap; ++k) ASSERT_EQ(dst[k], 0xEE) << "gap byte " << k << " written";
          at += gap;
          ASSERT_TRUE(std::equal(src.begin() + at, src.begin() + at + n, dst.begin() + at))
              << "a copy of " << n << " bytes, round " << round << ", " << helpers << " helpers";
          at += n;
        }
        for (std::size_t k = at; k < total; ++k) ASSERT_EQ(dst[k], 0xEE) << "last gap byte " << k << " written";
      }
    }
  }
}

// No thread is the caller alone; a count of helpers the claim word cannot
// number is refused before any thread starts.
TEST(parallel_memcpy, zero_threads_counts_as_the_caller_and_too_many_helpers_are_refused) {
  parallel_memcpy copier(3);
  std::vector<std::uint8_t> src(1 << 20), dst(1 << 20, 0);
  std::iota(src.begin(), src.end(), std::uint8_t{7});
  const copy_job job{reinterpret_cast<std::byte*>(dst.data()), reinterpret_cast<const std::byte*>(src.data()),
                     src.size()};
  copier.copy_all({&job, 1}, store_kind::automatic, 0);
  EXPECT_EQ(dst, src);
  EXPECT_THROW(parallel_memcpy(0xFFFF), invalid_argument);
}

// A helper that cannot be started (EAGAIN, as under a pids cgroup limit) is a
// typed error, not the end of the process: the helpers already started are
// stopped and joined before it is thrown.
TEST(parallel_memcpy, helpers_that_cannot_all_be_started_are_a_backend_error) {
  try {
    shoal::testing::refusing_threads refusal(2);
    parallel_memcpy copier(4);
    ADD_FAILURE() << "four helpers started where only two could";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("2 of 4"), std::string::npos) << e.what();
  }
  parallel_memcpy copier(2);  // threads start again once they may
  std::vector<std::uint8_t> src(1 << 20, 9), dst(1 << 20, 0);
  copier.copy(dst.data(), src.data(), src.size(), store_kind::automatic);
  EXPECT_EQ(dst, src);
}

}  // namespace
}  // namespace shoal::transfer
