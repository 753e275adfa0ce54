// Debug mode with cross-stream safety off marks a block freed on another
// stream with a hazard event, which a hand-out checks. The event belongs to
// the allocator's event pool: when the block's memory leaves the allocator
// (empty_cache gives its segment back, a private pool is destroyed) the
// event goes back to the pool, and the allocator's teardown destroys every
// event it made.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "support/forwarding_device.h"

namespace shoal::testing {
namespace {

class event_counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  backend::event_ref create_event() override {
    ++live;
    return forwarding_device::create_event();
  }
  void destroy_event(backend::event_ref event) override {
    --live;
    forwarding_device::destroy_event(event);
  }
  std::atomic<int> live{0};
};

const alloc::allocator_config debug_without_cross_stream_safety =
    alloc::allocator_config::parse("debug:true,cross_stream_safety:false");

// Device events made and not destroyed once an allocator (debug mode,
// cross-stream safety off) that ran `round` three times is gone. `round`
// gets the allocator, a block's own stream, another stream, and the device.
int events_left_after(
    const std::function<void(alloc::caching_allocator&, backend::stream_ref, backend::stream_ref, backend::device&)>&
        round) {
  backend::host_device host;
  event_counting_device dev(host);
  {
    backend::stream own(dev), other(dev);
    alloc::caching_allocator a(dev, debug_without_cross_stream_safety);
    for (int i = 0; i < 3; ++i) round(a, own.ref(), other.ref(), dev);
    other.synchronize();
  }
  return dev.live.load();
}

TEST(hazard_events, a_segment_given_back_by_empty_cache_gives_its_hazard_events_back) {
  EXPECT_EQ(events_left_after([](alloc::caching_allocator& a, backend::stream_ref own, backend::stream_ref other,
                                 backend::device&) {
              void* p = a.allocate(1 << 20, own);
              a.deallocate(p, other);  // freed elsewhere: marked with a hazard event
              a.empty_cache();         // the block is free: its segment goes back
            }),
            0);
}

TEST(hazard_events, a_destroyed_private_pool_gives_its_free_blocks_hazard_events_back) {
  EXPECT_EQ(events_left_after([](alloc::caching_allocator& a, backend::stream_ref own, backend::stream_ref other,
                                 backend::device&) {
              const auto pool = a.create_growing_private_pool();
              {
                alloc::private_pool_scope scope(a, pool);
                a.deallocate(a.allocate(1 << 20, own), other);
              }
              (void)a.destroy_private_pool(pool);
            }),
            0);
}

TEST(hazard_events, a_region_pool_destroyed_taking_back_its_blocks_gives_its_hazard_events_back) {
  EXPECT_EQ(events_left_after([](alloc::caching_allocator& a, backend::stream_ref own, backend::stream_ref other,
                                 backend::device& dev) {
              void* region = dev.allocate_segment(4 << 20);
              const auto pool = a.create_private_pool(region, 4 << 20);
              void* kept = nullptr;
              {
                alloc::private_pool_scope scope(a, pool);
                void* freed = a.allocate(1 << 20, own);
                kept = a.allocate(1 << 20, own);
                a.deallocate(freed, other);  // free, with a hazard event, when the pool goes
              }
              (void)a.destroy_private_pool(pool, alloc::live_blocks::invalidate);
              a.deallocate(kept, own);  // the tombstone's late free
              dev.synchronize(other);
              dev.free_segment(region);
            }),
            0);
}

}  // namespace
}  // namespace shoal::testing
