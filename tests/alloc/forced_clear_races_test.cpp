// Forced clears of private pools (live_blocks::invalidate) while their
// owners go on: frees and sends that come during the device-wide wait,
// blocks whose streams were destroyed, late frees whose streams still
// write. The clear takes back exactly what is still live, all or nothing,
// and no newer block is handed out before the old owner's work passed.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"
#include "support/forwarding_device.h"
#include "support/region_pool.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using alloc::live_blocks;
constexpr std::size_t mib = 1024 * 1024;

template <class Param>
using forced_clear_races = allocator_test<Param>;
TYPED_TEST_SUITE(forced_clear_races, backend_config_types, backend_config_names);

// A device that runs `during_next_wait` right after its next device-wide
// wait: what the owners do while a forced clear waits.
struct hooked_device : forwarding_device {
  using forwarding_device::forwarding_device;
  void synchronize_device() override {
    forwarding_device::synchronize_device();
    if (auto hook = std::exchange(during_next_wait, {})) hook();
  }
  std::function<void()> during_next_wait;
};

// The owner writes its block once more on its stream and frees it there:
// the free is done at once, the write still queued.
TYPED_TEST(forced_clear_races, a_free_during_the_device_wait_is_waited_for_before_its_memory_is_reused) {
  hooked_device dev(this->device());
  backend::stream owner(dev), next(dev);
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(this->configured_text("")));
  region_pool r(dev, a, 2 * mib);
  void* p = r.allocate(2 * mib, owner);
  dev.during_next_wait = [&] {
    dev.delay(owner, 300ms);
    dev.fill(owner, p, 0x5A, 2 * mib);
    a.deallocate(p, owner);
  };
  const auto taken = a.clear_private_pool(r.id, "", live_blocks::invalidate);
  EXPECT_TRUE(taken.blocks.empty()) << "the block was freed before it could be taken";
  void* newer = r.allocate(2 * mib, next);
  ASSERT_EQ(newer, r.base);
  dev.fill(next, newer, 0x22, 2 * mib);
  dev.synchronize(owner);
  EXPECT_TRUE(all_equal(this->read(newer, 2 * mib, next), 0x22)) << "the freed block's queued write landed in the newer block";
  a.deallocate(newer, next);
  dev.synchronize(next);
  a.destroy_private_pool(r.id);
}

// A free on another stream than the block's waits for that stream: it is
// still pending when the clear takes the lock. The clear waits for it
// rather than failing halfway with some blocks already cut to tombstones.
TYPED_TEST(forced_clear_races, a_cross_stream_free_during_the_device_wait_is_collected_not_half_taken) {
  for (const bool destroy : {false, true}) {
    SCOPED_TRACE(destroy ? "destroy_private_pool" : "clear_private_pool");
    hooked_device dev(this->device());
    backend::stream side(dev);
    alloc::caching_allocator a(dev, alloc::allocator_config::parse(this->configured_text("")));
    region_pool r(dev, a, 2 * mib);
    void* freed = r.allocate(mib);
    void* live = r.allocate(mib);
    dev.during_next_wait = [&] {
      dev.delay(side, 300ms);
      a.deallocate(freed, side);
    };
    const auto taken = destroy ? a.destroy_private_pool(r.id, live_blocks::invalidate)
                               : a.clear_private_pool(r.id, "", live_blocks::invalidate);
    ASSERT_EQ(taken.blocks.size(), 1u);
    EXPECT_EQ(taken.blocks[0].address, reinterpret_cast<std::uintptr_t>(live));
    const auto st = a.stats();
    EXPECT_TRUE(nothing_in_use(st));
    EXPECT_EQ(st.invalidated.aggregate.current, destroy ? 0 : 1) << st.to_json();
    EXPECT_NO_THROW(a.check_invariants());
    if (destroy) continue;
    a.deallocate(live, {});
    void* whole = r.allocate(2 * mib);
    EXPECT_EQ(whole, r.base) << "the region is one free block again";
    a.deallocate(whole, {});
    a.destroy_private_pool(r.id);
  }
}

// The check of blocks sent to another process runs with every sub-pool
// locked, before any is changed: a send during the wait refuses the
// destroy, and the other sub-pool's live block is not taken either.
TYPED_TEST(forced_clear_races, a_block_sent_during_the_device_wait_refuses_the_destroy_and_nothing_is_taken) {
  hooked_device dev(this->device());
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(this->configured_text("")));
  auto* base = dev.allocate_segment(4 * mib);
  const auto id = a.create_private_pool(base, 4 * mib, {{"first", 2 * mib}, {"second", 2 * mib}});
  const auto allocate = [&](const char* part) {
    alloc::private_pool_scope scope(a, id, part);
    return a.allocate(mib, {});
  };
  void* own = allocate("first");
  void* sent = allocate("second");
  dev.during_next_wait = [&] { a.mark_held_outside(sent); };
  EXPECT_THROW((void)a.destroy_private_pool(id, live_blocks::invalidate), invalid_argument);
  const auto st = a.stats();
  EXPECT_EQ(st.allocations.aggregate.current, 2) << "a block was taken: " << st.to_json();
  EXPECT_EQ(st.invalidated.aggregate.current, 0) << st.to_json();
  EXPECT_NO_THROW((void)a.block_size(own));
  EXPECT_NO_THROW(a.check_invariants());

  a.deallocate(sent, {});  // its holders let go
  const auto taken = a.destroy_private_pool(id, live_blocks::invalidate);
  ASSERT_EQ(taken.blocks.size(), 1u);
  EXPECT_EQ(taken.blocks[0].address, reinterpret_cast<std::uintptr_t>(own));
  dev.synchronize_device();
  dev.free_segment(base);
}

// The owner's late free says its last use is queued on its stream: a newer
// block there waits for it, even at the tombstone's bytes.
TYPED_TEST(forced_clear_races, a_block_handed_out_after_a_late_free_waits_for_the_late_free_stream) {
  auto& dev = this->device();
  backend::stream owner(dev), next(dev);
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(this->configured_text("")));
  region_pool r(dev, a, 2 * mib);
  void* stale = r.allocate(2 * mib, owner);
  (void)a.clear_private_pool(r.id, "", live_blocks::invalidate);
  dev.delay(owner, 300ms);
  dev.fill(owner, stale, 0x5A, 512);
  a.deallocate(stale, owner);
  void* newer = r.allocate(2 * mib, next);
  ASSERT_EQ(newer, r.base) << "the late free gave the tombstone back";
  dev.fill(next, newer, 0x22, 2 * mib);
  dev.synchronize(owner);
  EXPECT_TRUE(all_equal(this->read(newer, 512, next), 0x22)) << "the late free's queued write landed in the newer block";
  a.deallocate(newer, next);
  dev.synchronize(next);
  a.destroy_private_pool(r.id);
}

// Debug mode poisons what it takes back, but not on the blocks' streams,
// which their owners may have destroyed since.
TEST(forced_clear_races_host, debug_mode_takes_and_poisons_blocks_whose_stream_was_destroyed) {
  for (const bool destroy : {false, true}) {
    SCOPED_TRACE(destroy ? "destroy_private_pool" : "clear_private_pool");
    backend::host_device dev({.capacity_bytes = 64 * mib});
    alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true"));
    region_pool r(dev, a, 2 * mib);
    void* p = nullptr;
    {
      backend::stream gone(dev);
      p = r.allocate(mib, gone);
      dev.fill(gone, p, 0x22, mib);
      dev.synchronize(gone);
    }
    const auto taken = destroy ? a.destroy_private_pool(r.id, live_blocks::invalidate)
                               : a.clear_private_pool(r.id, "", live_blocks::invalidate);
    ASSERT_EQ(taken.blocks.size(), 1u);
    EXPECT_TRUE(all_equal(std::vector<std::uint8_t>(static_cast<std::uint8_t*>(p), static_cast<std::uint8_t*>(p) + mib),
                          0xDB))
        << "the taken block was not poisoned";
    EXPECT_NO_THROW(a.check_invariants());
    if (destroy) continue;
    a.deallocate(p, {});
    a.destroy_private_pool(r.id);
  }
}

// Debug mode poisons a collected free on the block's stream. One collected
// by a hand-out during the clear's device wait queues that poison after the
// wait: the clear's own poison of the region (on the default stream) must
// not start before it is done, or two fills write the same bytes at once.
TEST(forced_clear_races_host, a_poison_queued_during_the_device_wait_is_done_before_the_clear_poisons) {
  struct poison_watching_device : hooked_device {
    using hooked_device::hooked_device;
    void fill(backend::stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) override {
      if (stream.is_default() && dst == region) owner_idle_at_poison.push_back(query(owner));
      hooked_device::fill(stream, dst, value, bytes);
    }
    void* region = nullptr;
    backend::stream_ref owner{};
    std::vector<bool> owner_idle_at_poison;
  };
  for (const bool destroy : {false, true}) {
    SCOPED_TRACE(destroy ? "destroy_private_pool" : "clear_private_pool");
    backend::host_device host({.capacity_bytes = 64 * mib});
    poison_watching_device dev(host);
    backend::stream owner(dev), side(dev), next(dev);
    alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true"));
    region_pool r(dev, a, 2 * mib);
    dev.region = r.base;
    dev.owner = owner;
    void* p = r.allocate(mib, owner);
    a.record_stream(p, side);
    a.deallocate(p, owner);  // pending: waits for `side`
    dev.synchronize_device();
    void* whole = nullptr;
    dev.during_next_wait = [&] {
      dev.delay(owner, 200ms);
      whole = r.allocate(2 * mib, next);  // collects p: its poison queued on `owner`, behind the delay
    };
    const auto taken = destroy ? a.destroy_private_pool(r.id, live_blocks::invalidate)
                               : a.clear_private_pool(r.id, "", live_blocks::invalidate);
    ASSERT_EQ(taken.blocks.size(), 1u);
    EXPECT_EQ(taken.blocks[0].address, reinterpret_cast<std::uintptr_t>(whole));
    ASSERT_FALSE(dev.owner_idle_at_poison.empty()) << "the clear poisoned nothing on the default stream";
    for (const bool idle : dev.owner_idle_at_poison) {
      EXPECT_TRUE(idle) << "the clear poisoned the region while a collected free's poison was still queued";
    }
    EXPECT_NO_THROW(a.check_invariants());
    if (destroy) continue;
    a.deallocate(whole, {});
    a.destroy_private_pool(r.id);
  }
}

// A device that refuses to record events on one stream.
class refusing_records_on final : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void record(backend::event_ref event, backend::stream_ref stream) override {
    if (stream == refused) throw backend_error("record", "refused on this stream by the test");
    forwarding_device::record(event, stream);
  }
  backend::stream_ref refused;
};

// A private pool's free block remembers the streams that last used it; a
// hand-out on another stream waits for them, and a refused wait fails it.
// The refused allocation changes nothing (the block stays free, in its
// place), and a forced clear, which forgets those streams, makes the memory
// usable again.
TEST(forced_clear_races_host, a_hand_out_refused_for_its_last_stream_changes_nothing) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  refusing_records_on dev(host);
  alloc::caching_allocator a(dev, {});
  region_pool r(dev, a, 2 * mib);
  backend::stream last(dev), next(dev);
  void* p = r.allocate(mib, last);
  a.deallocate(p, last);
  dev.refused = last;
  EXPECT_THROW((void)r.allocate(mib, next), backend_error);
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_TRUE(nothing_in_use(a.stats())) << a.stats().to_json();
  EXPECT_TRUE(a.clear_private_pool(r.id, "", live_blocks::invalidate).blocks.empty());
  EXPECT_NO_THROW(a.check_invariants());
  void* q = r.allocate(2 * mib, next);
  EXPECT_EQ(q, r.base);
  a.deallocate(q, next);
  a.destroy_private_pool(r.id);
}

}  // namespace
}  // namespace shoal::testing
