// caching_allocator::deallocate_or_wait: a free that needs host memory for
// its bookkeeping (another stream than the block's, recorded streams,
// pinned memory), refused it, waits on the host for the streams it would
// have waited for and frees the block at once — where deallocate throws
// std::bad_alloc and keeps it (held_free_errors_test.cpp). Shown with every
// heap allocation refused: the block is freed, not before the work on its
// streams ran, and the allocator stays whole.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <new>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
constexpr std::size_t mib = std::size_t{1} << 20;

struct refused_free_case {
  const char* conf;
  int recorded;             // streams recorded on the block (record_stream) before its free
  bool on_another_stream;   // freed on one more stream, else on the block's own (the default)
  bool pinned = false;
};

void frees_after_waiting_for_the_streams(const refused_free_case& c) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(c.conf));
  std::deque<backend::stream> streams;
  for (int i = 0; i < c.recorded + (c.on_another_stream ? 1 : 0); ++i) streams.emplace_back(dev);
  void* p = a.allocate(512);
  for (int i = 0; i < c.recorded; ++i) a.record_stream(p, streams[static_cast<std::size_t>(i)].ref());
  const backend::stream_ref free_on = c.on_another_stream ? streams.back().ref() : backend::stream_ref{};

  // The control: deallocate refused the same way throws and keeps the block.
  bool threw = false;
  {
    const refusing_allocations refuse;  // no gtest assertion inside: its report allocates
    try {
      a.deallocate(p, free_on);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  EXPECT_TRUE(threw) << "the free took no heap memory: the test shows nothing";
  ASSERT_EQ(a.stats().allocations.aggregate.current, 1);

  // The last stream's work runs late; the free must wait for it.
  std::atomic<bool> ran{false};
  dev.host_task(streams.empty() ? backend::stream_ref{} : streams.back().ref(), [&ran] {
    std::this_thread::sleep_for(50ms);
    ran = true;
  });
  threw = false;
  {
    const refusing_allocations refuse;
    try {
      a.deallocate_or_wait(p, free_on);
    } catch (...) {
      threw = true;
    }
  }
  EXPECT_FALSE(threw);
  EXPECT_TRUE(ran) << "the block was freed before the work on its streams ran";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0) << "the block stayed allocated";
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_THROW(a.deallocate(p), invalid_argument) << "freed once already";
  void* again = a.allocate(512);  // the block serves again
  a.deallocate(again);
  dev.synchronize_device();
  a.empty_cache();
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
  if (!c.pinned) {  // pinned frees on their stream stay held until the stream's next call seals them
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "memory was lost";
  }
}

TEST(deallocate_or_wait, a_free_on_another_stream_refused_memory_waits_and_frees) {
  frees_after_waiting_for_the_streams({"", 0, true});
}

TEST(deallocate_or_wait, a_free_after_record_stream_refused_memory_waits_and_frees) {
  frees_after_waiting_for_the_streams({"", 2, false});
}

TEST(deallocate_or_wait, a_free_with_recorded_streams_on_another_stream_refused_memory_waits_and_frees) {
  frees_after_waiting_for_the_streams({"", 3, true});
}

TEST(deallocate_or_wait, a_pinned_host_free_refused_memory_waits_and_frees) {
  frees_after_waiting_for_the_streams({"memory:pinned_host", 0, false, true});
}

// More streams recorded on the block than the free takes at one look.
TEST(deallocate_or_wait, a_block_recorded_on_many_streams_waits_for_each) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, {});
  std::deque<backend::stream> streams;
  for (int i = 0; i < 12; ++i) streams.emplace_back(dev);
  void* p = a.allocate(512);
  for (auto& s : streams) a.record_stream(p, s.ref());
  std::atomic<bool> ran{false};
  dev.host_task(streams.back().ref(), [&ran] {
    std::this_thread::sleep_for(50ms);
    ran = true;
  });
  bool threw = false;
  int refused = 0;
  {
    const refusing_allocations refuse;  // no gtest assertion inside: its report allocates
    try {
      a.deallocate_or_wait(p, streams.front().ref());
    } catch (...) {
      threw = true;
    }
    refused = refusing_allocations::refused();
  }
  EXPECT_FALSE(threw);
  EXPECT_GT(refused, 0) << "the free took no heap memory: the test shows nothing";
  EXPECT_TRUE(ran) << "the block was freed before the work on its streams ran";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
  EXPECT_NO_THROW(a.check_invariants());
}

// The documented limit: in a private pool, making the block free takes
// memory too (the pool's last streams); refused, deallocate_or_wait throws
// as deallocate does, with the block still allocated and the pool whole.
TEST(deallocate_or_wait, in_a_private_pool_a_refusal_after_the_wait_keeps_the_block) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, {});
  backend::stream other(dev);
  const auto pool = a.create_growing_private_pool();
  void* p = nullptr;
  {
    const alloc::private_pool_scope scope(a, pool);
    p = a.allocate(512);
  }
  a.record_stream(p, other.ref());
  bool threw = false;
  {
    const refusing_allocations refuse;
    try {
      a.deallocate_or_wait(p, backend::stream_ref{});
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  EXPECT_TRUE(threw);
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1);
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_NO_THROW(a.deallocate_or_wait(p, backend::stream_ref{})) << "the block was not left allocated";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
  dev.synchronize_device();
  (void)a.destroy_private_pool(pool);
}

}  // namespace
}  // namespace shoal::testing
