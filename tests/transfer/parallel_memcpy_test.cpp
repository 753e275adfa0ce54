// The staging copy split across helper threads: every byte lands once, for
// sizes that do and do not divide into slices, back to back.
#include "transfer/parallel_memcpy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

namespace shoal::transfer {
namespace {

TEST(parallel_memcpy, every_byte_arrives_for_sizes_that_do_and_do_not_split_evenly) {
  for (std::size_t helpers : {0u, 1u, 3u, 7u}) {
    parallel_memcpy copier(helpers);
    for (std::size_t bytes : {std::size_t{1}, std::size_t{4096}, std::size_t{256} << 10, (std::size_t{1} << 20) + 7,
                              (std::size_t{8} << 20) + 4093}) {
      std::vector<std::uint8_t> src(bytes), dst(bytes, 0);
      std::iota(src.begin(), src.end(), static_cast<std::uint8_t>(bytes + helpers));
      copier.copy(dst.data(), src.data(), bytes);
      EXPECT_EQ(dst, src) << bytes << " bytes with " << helpers << " helpers";
    }
  }
}

TEST(parallel_memcpy, many_copies_back_to_back_each_complete_before_copy_returns) {
  parallel_memcpy copier(3);
  std::vector<std::uint8_t> src(3 << 20), dst(3 << 20);
  for (int round = 0; round < 200; ++round) {
    std::fill(src.begin(), src.end(), static_cast<std::uint8_t>(round));
    copier.copy(dst.data(), src.data(), src.size());
    ASSERT_EQ(dst.front(), static_cast<std::uint8_t>(round));
    ASSERT_EQ(dst.back(), static_cast<std::uint8_t>(round));
    ASSERT_EQ(dst[dst.size() / 2 + 1], static_cast<std::uint8_t>(round));
  }
}

}  // namespace
}  // namespace shoal::transfer
