// The direct queries: the largest free block of the ordinary pools, and the
// segment of an allocated block's start (what PyTorch's cacheInfo and
// torch.multiprocessing ask, without a snapshot).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "support/allocators.h"
#include "support/region_pool.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;

constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Backend>
using cache_queries = allocator_test<Backend>;
TYPED_TEST_SUITE(cache_queries, backend_types, backend_names);

/// The largest free block a snapshot shows (for allocators with no private pool).
std::size_t largest_free_in_snapshot(const alloc::caching_allocator& a) {
  std::size_t largest = 0;
  for (const auto& segment : a.take_snapshot().segments) {
    for (const auto& b : segment.blocks) {
      if (b.state == alloc::block_state::free) largest = std::max(largest, b.size);
    }
  }
  return largest;
}

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

TYPED_TEST(cache_queries, the_largest_free_block_is_zero_while_nothing_free_is_cached) {
  auto& dev = this->device();
  auto& a = this->make();
  EXPECT_EQ(a.largest_free_block(), 0u) << "a new allocator";
  stream mine(dev), other(dev);
  void* whole = a.allocate(12 * mib, mine);  // a segment of its own, exactly its size
  EXPECT_EQ(a.largest_free_block(), 0u) << "its segment is all allocated";
  dev.delay(other, 200ms);
  a.deallocate(whole, other);
  EXPECT_EQ(a.largest_free_block(), 0u) << "a block pending free is not reusable yet";
  dev.synchronize(other);
  a.process_pending_frees();
  EXPECT_EQ(a.largest_free_block(), 12 * mib) << "reusable once the freeing stream passed the free";
  a.empty_cache();
  EXPECT_EQ(a.largest_free_block(), 0u) << "the cache went back to the device";
}

TYPED_TEST(cache_queries, a_parked_block_counts_merged_with_its_free_neighbours) {
  auto& a = this->make();
  void* alone = a.allocate(12 * mib, {});
  a.deallocate(alone, {});  // parked: in no free bin
  EXPECT_EQ(a.largest_free_block(), 12 * mib) << "a parked block is free";

  void* first = a.allocate(8 * kib, {});
  void* second = a.allocate(8 * kib, {});
  a.deallocate(second, {});  // parked, beside the small segment's free tail
  a.empty_cache();  // the 12 MiB segment goes; `second` settles with the tail
  EXPECT_EQ(a.largest_free_block(), 2 * mib - 8 * kib);
  void* third = a.allocate(8 * kib, {});
  ASSERT_EQ(third, second);
  a.deallocate(third, {});  // parked again, the tail settled beside it
  EXPECT_EQ(a.largest_free_block(), 2 * mib - 8 * kib) << "the parked block and the tail after it are one block";
  EXPECT_EQ(a.largest_free_block(), largest_free_in_snapshot(a));
  a.deallocate(first, {});
}

TYPED_TEST(cache_queries, the_largest_free_block_is_looked_for_in_every_stream_and_both_size_classes) {
  auto& dev = this->device();
  auto& a = this->make();
  stream one(dev), two(dev);
  void* large = a.allocate(3 * mib, one);  // a 20 MiB segment: 17 MiB stay free
  void* small = a.allocate(512, two);
  EXPECT_EQ(a.largest_free_block(), 17 * mib) << "stream one's large pool";
  void* big = a.allocate(30 * mib, two);
  a.deallocate(big, two);
  EXPECT_EQ(a.largest_free_block(), 30 * mib) << "stream two's large pool";
  EXPECT_EQ(a.largest_free_block(), largest_free_in_snapshot(a));
  a.deallocate(large, one);
  a.deallocate(small, two);
  dev.synchronize(one);
  dev.synchronize(two);
}

TYPED_TEST(cache_queries, private_pools_free_blocks_are_not_counted) {
  auto& dev = this->device();
  auto& a = this->make();
  region_pool region(dev, a, 64 * mib);  // one free block of 64 MiB
  const auto growing = a.create_growing_private_pool();
  void* in_growing;
  {
    alloc::private_pool_scope scope(a, growing);
    in_growing = a.allocate(40 * mib, {});
  }
  a.deallocate(in_growing, {});
  void* ordinary = a.allocate(512, {});
  EXPECT_EQ(a.largest_free_block(), 2 * mib - 512) << "only the ordinary pools' free blocks";
  a.deallocate(ordinary, {});
  (void)a.destroy_private_pool(growing);
  (void)a.destroy_private_pool(region.id);
}

TYPED_TEST(cache_queries, the_segment_of_a_blocks_start_and_of_nothing_else) {
  auto& a = this->make();
  void* first = a.allocate(8 * kib, {});
  void* second = a.allocate(8 * kib, {});
  const std::optional<alloc::block_segment> found = a.segment_of_allocated_block(second);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->base, address(first)) << "a new small segment starts with its first block";
  EXPECT_EQ(found->size, 2 * mib);
  EXPECT_EQ(found->kind, alloc::segment_kind::plain);

  EXPECT_FALSE(a.segment_of_allocated_block(static_cast<char*>(second) + 512)) << "inside a block";
  const int elsewhere = 0;
  EXPECT_FALSE(a.segment_of_allocated_block(&elsewhere)) << "memory not the allocator's";
  a.deallocate(second, {});
  EXPECT_FALSE(a.segment_of_allocated_block(second)) << "a freed block";
  a.deallocate(first, {});
}

TYPED_TEST(cache_queries, a_block_of_a_growable_segment_names_its_kind) {
  auto& a = this->make("expandable_segments:true");
  if (!a.config().expandable_segments) GTEST_SKIP() << "the device has no growable ranges";
  void* p = a.allocate(8 * kib, {});
  const auto found = a.segment_of_allocated_block(p);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->kind, alloc::segment_kind::growable);
  EXPECT_LE(found->base, address(p));
  a.deallocate(p, {});
}

TYPED_TEST(cache_queries, private_pools_blocks_name_memory_handed_in_or_the_devices) {
  auto& dev = this->device();
  auto& a = this->make();
  region_pool region(dev, a, 4 * mib);
  void* handed = region.allocate(8 * kib);
  const auto in_region = a.segment_of_allocated_block(handed);
  ASSERT_TRUE(in_region.has_value());
  EXPECT_EQ(in_region->kind, alloc::segment_kind::handed_in);
  EXPECT_EQ(in_region->base, address(region.base));
  EXPECT_EQ(in_region->size, 4 * mib);

  const auto growing = a.create_growing_private_pool();
  void* grown;
  {
    alloc::private_pool_scope scope(a, growing);
    grown = a.allocate(8 * kib, {});
  }
  const auto in_growing = a.segment_of_allocated_block(grown);
  ASSERT_TRUE(in_growing.has_value());
  EXPECT_EQ(in_growing->kind, alloc::segment_kind::plain) << "a growing pool's memory is the device's";
  a.deallocate(grown, {});
  (void)a.destroy_private_pool(growing);

  const auto taken = a.clear_private_pool(region.id, "", alloc::live_blocks::invalidate);
  ASSERT_EQ(taken.blocks.size(), 1u);
  EXPECT_FALSE(a.segment_of_allocated_block(handed)) << "a tombstone is no allocated block";
  a.deallocate(handed, {});  // the late free
  (void)a.destroy_private_pool(region.id);
}

// On seeded random schedules of allocations and frees on two streams (parked
// blocks beside free neighbours, splits, settles, an empty cache now and
// then), the query agrees with a snapshot after every step.
TYPED_TEST(cache_queries, the_largest_free_block_agrees_with_a_snapshot_over_random_schedules) {
  auto& dev = this->device();
  constexpr std::size_t sizes[] = {512, 4 * kib, 8 * kib, 96 * kib, 1 * mib, 3 * mib, 12 * mib};
  for (const unsigned seed : {1U, 2U, 3U, 4U}) {
    auto& a = this->make();
    std::mt19937 random(seed);
    stream one(dev), two(dev);
    std::vector<std::pair<void*, backend::stream_ref>> live;
    for (int step = 0; step < 600; ++step) {
      const unsigned dice = random() % 100;
      if (dice < 2) {
        a.empty_cache();
      } else if (live.size() < 40 && (live.empty() || dice < 55)) {
        const backend::stream_ref on = random() % 2 ? one.ref() : two.ref();
        live.emplace_back(a.allocate(sizes[random() % std::size(sizes)], on), on);
      } else {
        const std::size_t i = random() % live.size();
        a.deallocate(live[i].first, live[i].second);
        live[i] = live.back();
        live.pop_back();
      }
      ASSERT_EQ(a.largest_free_block(), largest_free_in_snapshot(a)) << "seed " << seed << ", step " << step;
    }
    for (const auto& [p, on] : live) a.deallocate(p, on);
  }
}

// Four threads allocate and free on streams of their own, on seeded random
// schedules, asking for their own blocks' segments, while a fifth asks for
// the largest free block and for the segments of pointers the others publish
// (live, freed or reused by then): every answer is whole and true of the
// moment it was taken — a live block's segment holds it, any block's
// segment holds the pointer asked about. ThreadSanitizer runs it too.
TYPED_TEST(cache_queries, queries_answer_truly_while_other_threads_allocate_and_free) {
  auto& dev = this->device();
  auto& a = this->make();
  constexpr int workers = 4;
  constexpr int steps = 1500;
  constexpr std::size_t sizes[] = {512, 8 * kib, 1 * mib, 3 * mib, 24 * mib};
  std::array<std::atomic<std::uintptr_t>, 64> published{};
  std::atomic<int> running{workers};
  std::atomic<int> wrong{0};
  const auto holds = [](const alloc::block_segment& s, std::uintptr_t p) { return s.base <= p && p - s.base < s.size; };

  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 random(static_cast<unsigned>(w) + 1);
      stream own(dev);
      std::vector<void*> live;
      for (int step = 0; step < steps; ++step) {
        if (live.size() < 16 && (live.empty() || random() % 3 != 0)) {
          void* p = a.allocate(sizes[random() % std::size(sizes)], own);
          live.push_back(p);
          published[random() % published.size()].store(address(p), std::memory_order_relaxed);
          const auto segment = a.segment_of_allocated_block(p);
          if (!segment || !holds(*segment, address(p))) ++wrong;
        } else {
          const std::size_t i = random() % live.size();
          a.deallocate(live[i], own);
          live[i] = live.back();
          live.pop_back();
        }
      }
      for (void* p : live) a.deallocate(p, own);
      dev.synchronize(own);
      --running;
    });
  }
  threads.emplace_back([&] {
    std::mt19937 random(99);
    while (running > 0) {
      if (a.largest_free_block() % 512 != 0) ++wrong;  // blocks are whole multiples of 512 bytes
      const std::uintptr_t p = published[random() % published.size()].load(std::memory_order_relaxed);
      if (p == 0) continue;
      const auto segment = a.segment_of_allocated_block(reinterpret_cast<const void*>(p));
      if (segment && !holds(*segment, p)) ++wrong;
    }
  });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0) << "a query answered with a segment that did not hold its pointer";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
}

}  // namespace
}  // namespace shoal::testing
