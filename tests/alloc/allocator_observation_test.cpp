// Reading the allocator's reports (stats, snapshots) changes nothing: the
// same operations hand out the same blocks and reserve the same memory
// whether or not something polls the allocator in between.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "support/allocators.h"

namespace shoal::testing {
namespace {

constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Param>
using allocator_observation = allocator_test<Param>;
TYPED_TEST_SUITE(allocator_observation, backend_config_types, backend_config_names);

enum class poll : std::uint8_t { never, stats, snapshot };

void observe(const alloc::caching_allocator& a, poll how) {
  if (how == poll::stats) (void)a.stats();
  if (how == poll::snapshot) (void)a.take_snapshot();
}

// Two freed blocks of one size, parked: `x` alone between live blocks, `y`
// beside the segment's free tail. Returns the offset from x of the block a
// third request of that size gets.
std::ptrdiff_t reuse_after_two_frees(alloc::caching_allocator& a, poll how) {
  void* x = a.allocate(8 * kib, {});
  void* wall = a.allocate(512, {});
  void* y = a.allocate(8 * kib, {});
  a.deallocate(x, {});
  a.deallocate(y, {});
  observe(a, how);
  observe(a, how);
  void* again = a.allocate(8 * kib, {});
  const auto offset = static_cast<char*>(again) - static_cast<char*>(x);
  a.deallocate(again, {});
  a.deallocate(wall, {});
  return offset;
}

TYPED_TEST(allocator_observation, polling_between_frees_and_a_request_leaves_the_block_it_gets) {
  const auto unobserved = reuse_after_two_frees(this->make(), poll::never);
  EXPECT_EQ(reuse_after_two_frees(this->make(), poll::stats), unobserved) << "stats() in between";
  EXPECT_EQ(reuse_after_two_frees(this->make(), poll::snapshot), unobserved) << "take_snapshot() in between";
}

// What a run leaves behind, in terms that do not depend on where the device
// put the segments: every statistic, and each segment's blocks in order.
struct outcome {
  std::int64_t peak_reserved = 0;
  std::string stats;
  std::vector<std::vector<std::pair<std::size_t, alloc::block_state>>> segments;
};

// A deterministic churn on one stream, with sizes that repeat (so freed
// blocks park and are taken back by exact size) and some that do not.
// Returns the blocks still live.
std::vector<void*> churn_steps(alloc::caching_allocator& a, poll how, int operations) {
  std::mt19937 random(12);
  std::vector<void*> live;
  for (int op = 0; op < operations; ++op) {
    if (live.empty() || random() % 100 < 55) {
      const std::size_t bytes = random() % 3 == 0 ? 1 + random() % (3 * mib) : 4 * kib * (1 + random() % 16);
      live.push_back(a.allocate(bytes, {}));
    } else {
      const std::size_t i = random() % live.size();
      a.deallocate(live[i], {});
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (op % 3 == 0) observe(a, how);
  }
  return live;
}

outcome churn(alloc::caching_allocator& a, poll how, int operations) {
  const std::vector<void*> live = churn_steps(a, how, operations);
  outcome out;
  const auto st = a.stats();
  out.peak_reserved = st.reserved_bytes.aggregate.peak;
  out.stats = st.to_json();
  for (const auto& s : a.take_snapshot().segments) {
    auto& blocks = out.segments.emplace_back();
    for (const auto& b : s.blocks) blocks.emplace_back(b.size, b.state);
  }
  for (void* p : live) a.deallocate(p, {});
  return out;
}

TYPED_TEST(allocator_observation, polling_during_a_churn_changes_neither_its_statistics_nor_its_blocks) {
  // Debug poisons every freed block (and parks none): a shorter churn.
  const int operations = this->debug ? 600 : 3000;
  const outcome unobserved = churn(this->make(), poll::never, operations);
  for (const poll how : {poll::stats, poll::snapshot}) {
    const char* what = how == poll::stats ? "stats() every third operation" : "take_snapshot() every third operation";
    const outcome observed = churn(this->make(), how, operations);
    EXPECT_EQ(observed.peak_reserved, unobserved.peak_reserved) << what;
    EXPECT_EQ(observed.stats, unobserved.stats) << what;
    EXPECT_TRUE(observed.segments == unobserved.segments) << what << ": the blocks differ";
  }
}

// stats() shows parked blocks merged without merging them; empty_cache()
// settles them (and gives back only wholly free segments, which are never
// inactive splits). Every inactive split counter, allocated and freed
// included, must read the same before and after, and the current ones must
// match the snapshot's free blocks that share their segment.
void expect_inactive_split_read_as_settling_leaves_it(alloc::caching_allocator& a) {
  const alloc::allocator_stats view = a.stats();
  std::int64_t split_blocks = 0, split_bytes = 0;
  for (const auto& s : a.take_snapshot().segments) {
    if (s.expandable || s.blocks.size() < 2) continue;
    for (const auto& b : s.blocks) {
      if (b.state != alloc::block_state::free) continue;
      ++split_blocks;
      split_bytes += static_cast<std::int64_t>(b.size);
    }
  }
  EXPECT_EQ(view.inactive_split.aggregate.current, split_blocks);
  EXPECT_EQ(view.inactive_split_bytes.aggregate.current, split_bytes);
  a.empty_cache();
  const alloc::allocator_stats settled = a.stats();
  for (const auto& [name, before, after] :
       {std::tuple{"inactive_split", view.inactive_split, settled.inactive_split},
        std::tuple{"inactive_split_bytes", view.inactive_split_bytes, settled.inactive_split_bytes}}) {
    EXPECT_EQ(after.aggregate.current, before.aggregate.current) << name;
    EXPECT_EQ(after.aggregate.peak, before.aggregate.peak) << name;
    EXPECT_EQ(after.aggregate.allocated, before.aggregate.allocated) << name;
    EXPECT_EQ(after.aggregate.freed, before.aggregate.freed) << name;
  }
  EXPECT_NO_THROW(a.check_invariants());
}

TYPED_TEST(allocator_observation, the_inactive_split_counters_read_are_those_settling_leaves) {
  {
    // A run of parked blocks: x and y side by side, each parked as it is
    // freed, between a live block and the segment's free tail.
    auto& a = this->make();
    void* x = a.allocate(8 * kib, {});
    void* y = a.allocate(8 * kib, {});
    void* wall = a.allocate(8 * kib, {});
    a.deallocate(y, {});
    a.deallocate(x, {});
    expect_inactive_split_read_as_settling_leaves_it(a);
    a.deallocate(wall, {});
  }
  {
    // Whatever a churn leaves parked.
    auto& a = this->make();
    const std::vector<void*> live = churn_steps(a, poll::never, this->debug ? 600 : 3000);
    expect_inactive_split_read_as_settling_leaves_it(a);
    for (void* p : live) a.deallocate(p, {});
  }
}

// The snapshot numbers segments in the order they were taken (what
// PyTorch's NCCL registration walks a pool's segments by, the same on every
// rank): a segment keeps its number, and a number is not used again.
TYPED_TEST(allocator_observation, segments_are_numbered_in_the_order_they_were_taken) {
  auto& a = this->make("expandable_segments:false");  // one segment per growth, in every configuration
  const auto number_of = [&](void* p) -> std::uint64_t {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    for (const auto& s : a.take_snapshot().segments) {
      if (s.address <= at && at < s.address + s.size) return s.sequence;
    }
    ADD_FAILURE() << "no segment holds " << p;
    return 0;
  };
  void* small = a.allocate(1 * kib, {});
  void* large = a.allocate(30 * mib, {});
  const std::uint64_t first = number_of(small), second = number_of(large);
  EXPECT_GT(first, 0U);
  EXPECT_LT(first, second);
  a.deallocate(large, {});
  a.empty_cache();  // the large segment goes back
  const auto pool = a.create_growing_private_pool();
  void* pooled = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    pooled = a.allocate(30 * mib, {});
  }
  void* later = a.allocate(30 * mib, {});
  EXPECT_GT(number_of(pooled), second) << "the number of a segment given back is not used again";
  EXPECT_GT(number_of(later), number_of(pooled));
  EXPECT_EQ(number_of(small), first) << "a segment keeps its number";
  for (void* p : {small, pooled, later}) a.deallocate(p, {});
  (void)a.destroy_private_pool(pool);
}

}  // namespace
}  // namespace shoal::testing
