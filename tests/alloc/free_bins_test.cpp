// The free bins' best fit against a plain model: among the free blocks of at
// least the request, the smallest, and among blocks of that size the one
// inserted last (the bins' list order). Seeded random walks of inserts,
// removes and searches, with sizes crowded at bin boundaries and many blocks
// of one size (a bin of whole idle segments), where the search may stop early.
#include "alloc/free_bins.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <deque>
#include <list>
#include <random>
#include <vector>

namespace shoal::alloc::detail {
namespace {

constexpr std::size_t kib = 1024, mib = kib * kib;

// The smallest size of each of the eight bins per power of two at and above
// 1 MiB (below it, every 512-byte size has its own bin), up to 64 MiB.
std::vector<std::size_t> coarse_bin_floors() {
  std::vector<std::size_t> floors;
  for (std::size_t power = mib; power < 64 * mib; power *= 2) {
    for (std::size_t sub = 0; sub < 8; ++sub) floors.push_back(power + sub * (power / 8));
  }
  return floors;
}

class model {
 public:
  void insert(block* b) { order_.push_front(b); }
  void remove(block* b) { order_.remove(b); }
  [[nodiscard]] block* best_fit(std::size_t bytes) const {
    block* best = nullptr;
    for (block* b : order_) {
      if (b->size >= bytes && (best == nullptr || b->size < best->size)) best = b;
    }
    return best;
  }

 private:
  std::list<block*> order_;  // the most recently inserted first
};

std::size_t random_size(std::mt19937_64& rng, const std::vector<std::size_t>& floors) {
  const std::size_t floor = floors[rng() % floors.size()];
  switch (rng() % 6) {
    case 0:
    case 1:
      return floor;  // crowded at a bin's least size
    case 2:
      return floor + 512 * (rng() % 4);  // just above it
    case 3:
      return floor - 512 * (1 + rng() % 2);  // just below it: the bin before
    case 4:
      return 2 * mib;  // one size many times: whole idle small-pool segments
    default:
      return 512 * (1 + rng() % 2048);  // the exact bins below 1 MiB
  }
}

TEST(free_bins, best_fit_is_the_smallest_fitting_block_inserted_last_on_random_walks) {
  const auto floors = coarse_bin_floors();
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    std::deque<block> storage(400);  // stable addresses
    std::vector<block*> outside, inside;
    for (block& b : storage) outside.push_back(&b);
    free_bins bins;
    model reference;
    for (int step = 0; step < 4000; ++step) {
      const auto action = rng() % 3;
      if (action == 0 && !outside.empty()) {
        const std::size_t i = rng() % outside.size();
        block* b = outside[i];
        outside.erase(outside.begin() + static_cast<std::ptrdiff_t>(i));
        b->size = random_size(rng, floors);
        bins.insert(b);
        reference.insert(b);
        inside.push_back(b);
      } else if (action == 1 && !inside.empty()) {
        const std::size_t i = rng() % inside.size();
        block* b = inside[i];
        inside.erase(inside.begin() + static_cast<std::ptrdiff_t>(i));
        bins.remove(b);
        reference.remove(b);
        outside.push_back(b);
      } else {
        // Requests are rounded to 512 bytes by the allocator; odd ones too here.
        std::size_t bytes = random_size(rng, floors);
        if (rng() % 8 == 0) bytes -= 1 + rng() % 511;
        ASSERT_EQ(bins.best_fit(bytes), reference.best_fit(bytes))
            << "seed " << seed << ", step " << step << ", request of " << bytes << " bytes";
      }
    }
    EXPECT_EQ(bins.inconsistency(), "") << "seed " << seed;
  }
}

TEST(free_bins, among_blocks_of_one_size_the_last_inserted_is_taken_and_a_smaller_later_one_still_wins) {
  std::deque<block> storage(4);
  free_bins bins;
  storage[0].size = 2 * mib;
  storage[1].size = 2 * mib;
  bins.insert(&storage[0]);
  bins.insert(&storage[1]);
  EXPECT_EQ(bins.best_fit(4 * kib), &storage[1]) << "the last inserted of the least size";
  // 2 MiB + 512 shares the bin of 2 MiB, inserted last (first in the list):
  // the walk must go past it to the 2 MiB blocks.
  storage[2].size = 2 * mib + 512;
  bins.insert(&storage[2]);
  EXPECT_EQ(bins.best_fit(4 * kib), &storage[1]);
  EXPECT_EQ(bins.best_fit(2 * mib + 1), &storage[2]) << "the request's own bin holds smaller blocks";
  bins.remove(&storage[1]);
  EXPECT_EQ(bins.best_fit(4 * kib), &storage[0]);
}

}  // namespace
}  // namespace shoal::alloc::detail
