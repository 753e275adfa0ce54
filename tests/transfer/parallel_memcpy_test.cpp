// The staging copy split across helper threads: every byte lands once, for
// sizes that do and do not divide into slices, with either kind of store,
// back to back and after the helpers have gone to sleep.
#include "transfer/parallel_memcpy.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <numeric>
#include <thread>
#include <vector>

namespace shoal::transfer {
namespace {

TEST(parallel_memcpy, every_byte_arrives_for_sizes_that_do_and_do_not_split_evenly) {
  for (store_kind stores : {store_kind::cached, store_kind::streaming}) {
    for (std::size_t helpers : {0u, 1u, 3u, 7u}) {
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
// them (a lost wake-up would leave the caller copying every slice alone, or
// waiting forever for a slice no one took).
TEST(parallel_memcpy, a_copy_after_the_helpers_fell_asleep_completes_with_every_byte) {
  parallel_memcpy copier(3);
  std::vector<std::uint8_t> src(4 << 20), dst(4 << 20);
  for (int round = 0; round < 5; ++round) {
    std::this_thread::sleep_for(parallel_memcpy::spin_window * 5);
    std::fill(src.begin(), src.end(), static_cast<std::uint8_t>(round + 1));
    copier.copy(dst.data(), src.data(), src.size(), store_kind::streaming);
    ASSERT_EQ(dst, src) << "round " << round;
  }
}

}  // namespace
}  // namespace shoal::transfer
