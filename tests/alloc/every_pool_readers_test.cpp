// Threads that read every pool while others allocate — statistics, and the
// sweep of destroyed streams listing the streams recorded on live blocks:
// one heavy fence for all pools, and the pools stay with the threads that
// use them (a read no longer costs them their bias, so a pool read every few
// milliseconds does not fall back to the atomic lock).
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "alloc/allocator_core.h"
#include "alloc/asymmetric_fence.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "support/refused_allocations.h"

namespace shoal {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

// Allocates and frees on each of `streams` often enough for each pool's
// lock to be biased to this thread (16 takes in a row: two a pair).
void use_each_pool(alloc::caching_allocator& a, const std::vector<backend::stream_ref>& streams) {
  for (int i = 0; i < 32; ++i) {
    for (auto s : streams) {
      a.deallocate(a.allocate(512, s), s);
      a.deallocate(a.allocate(4 * mib, s), s);
    }
  }
}

// A host allocator with four streams of this thread's (eight pools).
class every_pool_readers : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!alloc::detail::asymmetric_fences_available()) GTEST_SKIP() << "no membarrier(2) here: no pool is biased";
    for (int i = 0; i < 4; ++i) streams.push_back(dev.create_stream());
  }
  void TearDown() override {
    for (auto s : streams) dev.destroy_stream(s);
  }
  // Whether another thread gets and frees a block of each of the eight pools
  // within 10 s, as it does unless one was left held (the future's end then
  // waits on: ctest's timeout ends the test).
  bool each_pool_serves_another_thread() {
    auto others = std::async(std::launch::async, [&] {
      for (auto s : streams) {
        a.deallocate(a.allocate(512, s), s);
        a.deallocate(a.allocate(4 * mib, s), s);
      }
    });
    return others.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  }
  backend::host_device dev{{.capacity_bytes = 256 * mib}};
  alloc::caching_allocator a{dev, {}};
  std::vector<backend::stream_ref> streams;
};

TEST_F(every_pool_readers, a_stats_read_of_every_pool_takes_one_heavy_fence_and_leaves_the_pools_biased) {
  use_each_pool(a, streams);  // 8 pools, small and large of 4 streams, biased to this thread
  for (int read = 0; read < 3; ++read) {
    SCOPED_TRACE("read " + std::to_string(read));
    const std::uint64_t before = alloc::detail::heavy_fences_so_far();
    alloc::allocator_stats seen;
    std::thread([&] { seen = a.stats(); }).join();
    // One for all eight (a read that revoked each bias would take eight,
    // and a second read none: the biases gone).
    EXPECT_EQ(alloc::detail::heavy_fences_so_far() - before, 1U);
    EXPECT_EQ(seen.allocations.aggregate.allocated, static_cast<std::int64_t>(streams.size()) * 64 * (read + 1));
    use_each_pool(a, streams);
  }
}

// Every reader of every pool, from another thread, after the pools were
// biased again: one fence each (a reader that took each pool's lock would
// revoke each bias, eight fences).
TEST_F(every_pool_readers, each_reader_of_every_pool_takes_one_heavy_fence) {
  const std::vector<std::pair<std::string, std::function<void()>>> readers = {
      {"stats", [&] { (void)a.stats(); }},
      {"take_snapshot", [&] { EXPECT_FALSE(a.take_snapshot().segments.empty()); }},
      {"largest_free_block", [&] { EXPECT_GT(a.largest_free_block(), 0U); }},
      {"reset_peak_stats", [&] { a.reset_peak_stats(); }},
      {"reset_accumulated_stats", [&] { a.reset_accumulated_stats(); }},
  };
  for (const auto& [name, read] : readers) {
    SCOPED_TRACE(name);
    use_each_pool(a, streams);
    const std::uint64_t before = alloc::detail::heavy_fences_so_far();
    std::thread(read).join();
    EXPECT_EQ(alloc::detail::heavy_fences_so_far() - before, 1U);
  }
}

TEST_F(every_pool_readers, a_sweep_listing_recorded_streams_takes_one_heavy_fence_for_other_threads_pools) {
  if (alloc::detail::library_checks_every_step()) {
    GTEST_SKIP() << "this build checks the invariants after every step, taking every pool's lock from the sweeping "
                    "thread too";
  }
  use_each_pool(a, streams);  // 8 pools biased to this thread
  void* kept = a.allocate(mib, streams[0]);
  a.record_stream(kept, streams[1]);  // so a sweep lists the streams recorded on live blocks
  std::uint64_t fences = 0;
  std::thread([&] {
    const backend::stream_ref gone = dev.create_stream();
    a.deallocate(a.allocate(mib, gone), gone);
    dev.destroy_stream(gone);  // held by the allocator: its sweep lets it go
    const backend::stream_ref next = dev.create_stream();
    const std::uint64_t before = alloc::detail::heavy_fences_so_far();
    void* p = a.allocate(mib, next);  // a new stream's first allocation: sweeps
    fences = alloc::detail::heavy_fences_so_far() - before;
    a.deallocate(p, next);
    dev.synchronize(next);
    dev.destroy_stream(next);
  }).join();
  // One for the eight (a listing that took each pool's lock would revoke
  // each bias, eight fences).
  EXPECT_EQ(fences, 1U);
  a.deallocate(kept, streams[0]);
}

// A snapshot that runs out of host memory while it copies a pool throws
// std::bad_alloc once every pool is let go: another thread then uses each
// pool at once, and the next snapshot is whole.
TEST_F(every_pool_readers, a_snapshot_refused_memory_midway_lets_every_pool_go_and_throws) {
  use_each_pool(a, streams);
  std::vector<void*> live;
  for (auto s : streams) live.push_back(a.allocate(mib, s));  // a segment in each large pool to copy
  // A snapshot's last allocation is the copy's, inside the look (nothing
  // after the look allocates): refuse that one.
  int last = 0;
  for (int nth = 1; nth < 1000; ++nth) {
    testing::refusing_one_allocation refuse(nth, [] {});
    try {
      (void)a.take_snapshot();
    } catch (const std::bad_alloc&) {
    }
    if (!refuse.refused()) break;
    last = nth;
  }
  ASSERT_GT(last, 0);
  {
    testing::refusing_one_allocation refuse(last, [] {});
    EXPECT_THROW((void)a.take_snapshot(), std::bad_alloc);
    EXPECT_TRUE(refuse.refused());
  }
  ASSERT_TRUE(each_pool_serves_another_thread()) << "a pool was left held";
  EXPECT_EQ(static_cast<std::int64_t>(a.take_snapshot().segments.size()), a.stats().segments.aggregate.current)
      << "the next snapshot is whole";
  for (std::size_t i = 0; i < live.size(); ++i) a.deallocate(live[i], streams[i]);
}

// A sweep of destroyed streams that runs out of host memory anywhere — the
// list of destroyed streams, the list of streams recorded on live blocks
// (grown several times inside its look of every pool), a stream's quiescing,
// the release of cached memory — lets every pool go: empty_cache throws
// std::bad_alloc or completes, another thread then uses each pool at once,
// and a sweep with memory lets every destroyed stream go.
TEST_F(every_pool_readers, a_sweep_refused_memory_anywhere_lets_every_pool_go) {
  if (alloc::detail::library_checks_every_step()) {
    GTEST_SKIP() << "this build checks the invariants after every step: the checker's own allocations would be "
                    "refused too";
  }
  use_each_pool(a, streams);
  std::vector<backend::stream_ref> recorded_on;
  for (int i = 0; i < 20; ++i) recorded_on.push_back(dev.create_stream());
  void* kept = a.allocate(mib, streams[0]);
  for (auto s : recorded_on) a.record_stream(kept, s);  // the listing holds 20 streams: 6 growths
  std::vector<backend::stream_ref> destroyed;
  int refused = 0;
  for (int nth = 1; nth < 1000; ++nth) {
    SCOPED_TRACE("allocation " + std::to_string(nth) + " refused");
    const backend::stream_ref gone = dev.create_stream();
    a.deallocate(a.allocate(512, gone), gone);
    dev.destroy_stream(gone);  // held by the allocator until a sweep lets it go
    destroyed.push_back(gone);
    bool was_refused = false;
    {
      testing::refusing_one_allocation refuse(nth, [] {});
      try {
        a.empty_cache();
      } catch (const std::bad_alloc&) {
      }
      was_refused = refuse.refused();
    }
    ASSERT_TRUE(each_pool_serves_another_thread()) << "a pool was left held";
    if (!was_refused) break;  // every allocation of a sweep was refused once
    ++refused;
  }
  EXPECT_GT(refused, 6) << "fewer allocations than the listing's growths alone";
  a.empty_cache();
  for (auto s : destroyed) EXPECT_FALSE(dev.stream_destroy_pending(s)) << "a destroyed stream still held";
  a.deallocate(kept, streams[0]);
  dev.synchronize(streams[0]);
  for (auto s : recorded_on) dev.destroy_stream(s);
}

}  // namespace
}  // namespace shoal
