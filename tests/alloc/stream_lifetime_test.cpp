// Streams the allocator used, destroyed by their owners once their blocks
// are freed: the allocator holds each (device::hold_stream) until its own
// teardown, so giving cached memory back, which synchronizes the stream,
// still works, and a new stream never takes the old one's handle and pools.
#include <gtest/gtest.h>

#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"
#include "support/region_pool.h"

namespace shoal::testing {
namespace {

using backend::stream;
constexpr std::size_t mib = 1024 * 1024;

template <class Backend>
using stream_lifetime = allocator_test<Backend>;
TYPED_TEST_SUITE(stream_lifetime, backend_config_types, backend_config_names);

TYPED_TEST(stream_lifetime, a_stream_destroyed_after_its_blocks_were_freed_leaves_the_cache_usable) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream_ref gone_ref;
  {
    stream gone(dev);
    gone_ref = gone.ref();
    void* p = a.allocate(4 * mib, gone);
    dev.fill(gone, p, 1, 4 * mib);
    a.deallocate(p, gone);
  }  // destroyed by its owner, its fill perhaps still queued
  EXPECT_NO_THROW(a.empty_cache()) << "giving the stream's cached memory back synchronizes it";
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
  EXPECT_NO_THROW(a.check_invariants());
  this->allocator_.reset();  // its hold ends: the stream is destroyed now
  EXPECT_THROW(dev.synchronize(gone_ref), invalid_argument) << "the allocator's teardown destroyed it";
}

// Out of memory, the allocator gives back what other streams' pools cache,
// synchronizing each: a destroyed stream's cache too.
TYPED_TEST(stream_lifetime, memory_cached_for_a_destroyed_stream_serves_another_stream_at_the_limit) {
  auto& dev = this->device();
  auto& a = this->make("memory_limit_mb:48");
  {
    stream gone(dev);
    void* p = a.allocate(32 * mib, gone);
    a.deallocate(p, gone);
  }
  stream next(dev);
  void* q = nullptr;
  ASSERT_NO_THROW(q = a.allocate(32 * mib, next)) << "the destroyed stream's 32 MiB went back first";
  a.deallocate(q, next);
  dev.synchronize(next);
  EXPECT_NO_THROW(a.check_invariants());
}

// A destroyed stream's handle could name the next stream made (CUDA and the
// host backend reuse them): that stream would take the old one's pools,
// whose blocks the old stream's queued work may still use. Held, no handle
// is reused while the allocator keeps its pools (here, each keeps a live
// block; destroyed_streams_test.cpp shows when they go).
TYPED_TEST(stream_lifetime, a_new_stream_never_takes_the_handle_of_a_destroyed_one_whose_pools_remain) {
  auto& dev = this->device();
  auto& a = this->make();
  std::set<void*> handles;
  std::vector<std::pair<void*, backend::stream_ref>> live;
  for (int i = 0; i < 8; ++i) {
    stream s(dev);
    EXPECT_TRUE(handles.insert(s.ref().native).second) << "stream " << i << " took a destroyed stream's handle";
    live.emplace_back(a.allocate(mib, s), s.ref());
    dev.synchronize(s);
  }
  for (auto [p, s] : live) a.deallocate(p, s);
  a.empty_cache();
}

// Streams a private pool's free block remembers that no allocation named:
// a tombstone's late free's, and record_stream's carried by a restore. A
// hand-out on another stream waits for them after their owners destroyed
// them.
TEST(stream_lifetime_host, a_tombstones_late_free_stream_is_held) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, {});
  region_pool r(dev, a, 2 * mib);
  stream owner(dev), next(dev);
  void* p = r.allocate(mib, owner);
  (void)a.clear_private_pool(r.id, "", alloc::live_blocks::invalidate);
  {
    stream freer(dev);
    a.deallocate(p, freer);  // the late free, on a stream only passed to deallocate
  }  // destroyed by its owner after the free
  void* q = nullptr;
  EXPECT_NO_THROW(q = r.allocate(mib, next)) << "the hand-out waits for the late free's stream";
  if (q != nullptr) a.deallocate(q, next);
  dev.synchronize(next);
}

TEST(stream_lifetime_host, record_streams_a_restore_keeps_as_last_streams_are_held) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, {});
  const auto pool = a.create_growing_private_pool();
  stream owner(dev), next(dev);
  void* kept;
  {
    alloc::private_pool_scope scope(a, pool);
    kept = a.allocate(mib, owner);
  }
  const auto checkpoint = a.checkpoint_private_pool(pool);
  {
    alloc::private_pool_scope scope(a, pool);
    void* p = a.allocate(mib, owner);
    stream reader(dev);
    a.record_stream(p, reader);
    (void)a.restore_private_pool(pool, checkpoint);  // frees p, remembering `reader`
  }  // `reader` destroyed by its owner
  void* q = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    EXPECT_NO_THROW(q = a.allocate(mib, next)) << "the hand-out waits for the record_stream stream";
  }
  if (q != nullptr) a.deallocate(q, next);
  a.deallocate(kept, owner);
  dev.synchronize(next);
  dev.synchronize(owner);
}

// At teardown the allocator waits for the streams a private pool's blocks
// remember before the memory goes: a record_stream stream's queued write,
// its stream destroyed by its owner meanwhile, lands in memory still mapped.
TEST(stream_lifetime_host, teardown_waits_for_the_queued_work_of_streams_blocks_remember) {
  using namespace std::chrono_literals;
  backend::host_device dev({.capacity_bytes = 64 * mib});
  std::optional<alloc::caching_allocator> a(std::in_place, dev, alloc::allocator_config{});
  const auto pool = a->create_growing_private_pool();
  stream owner(dev);
  const auto checkpoint = a->checkpoint_private_pool(pool);
  {
    alloc::private_pool_scope scope(*a, pool);
    void* p = a->allocate(mib, owner);
    stream reader(dev);
    dev.delay(reader, 300ms);
    dev.fill(reader, p, 0x5A, mib);
    a->record_stream(p, reader);
    (void)a->restore_private_pool(pool, checkpoint);  // frees p, remembering `reader`
  }  // `reader` destroyed by its owner, its fill still queued
  a.reset();  // unmapped before the fill ran, the fill would fault
  SUCCEED();
}

}  // namespace
}  // namespace shoal::testing
