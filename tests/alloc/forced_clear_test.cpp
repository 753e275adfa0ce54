// Forced clears of private pools (live_blocks::invalidate): live blocks are
// taken back and reported, each leaves a tombstone so that its owner's late
// free never frees a newer block, the whole device is waited for first,
// blocks shared with another process are refused, and debug poison is
// passed before the memory is reused.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
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
constexpr std::size_t kib = 1024, mib = kib * kib;

std::string hex(const void* p) {
  std::ostringstream out;
  out << "0x" << std::hex << reinterpret_cast<std::uintptr_t>(p);
  return out.str();
}

template <class Param>
using forced_clear = allocator_test<Param>;
TYPED_TEST_SUITE(forced_clear, backend_config_types, backend_config_names);

TYPED_TEST(forced_clear, takes_live_blocks_back_and_reports_them) {
  auto& a = this->make();
  region_pool r(this->device(), a, 4 * mib);
  void* p = r.allocate(mib);
  void* q = r.allocate(256 * kib);
  EXPECT_THROW(a.clear_private_pool(r.id), invalid_argument) << "refused unless forced";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 2) << "a refused clear changes nothing";

  const auto taken = a.clear_private_pool(r.id, "", live_blocks::invalidate);
  ASSERT_EQ(taken.blocks.size(), 2u);
  EXPECT_EQ(taken.blocks[0].address, reinterpret_cast<std::uintptr_t>(p));
  EXPECT_EQ(taken.blocks[0].size, mib);
  EXPECT_EQ(taken.blocks[1].address, reinterpret_cast<std::uintptr_t>(q));
  EXPECT_EQ(taken.blocks[1].size, 256 * kib);
  EXPECT_EQ(taken.bytes, mib + 256 * kib);
  const auto st = a.stats();
  EXPECT_TRUE(nothing_in_use(st)) << "tombstones are not allocated memory";
  EXPECT_EQ(st.invalidated.aggregate.current, 2) << st.to_json();
  EXPECT_EQ(st.invalidated_bytes.aggregate.current, 1024) << st.to_json();
  EXPECT_EQ(count_blocks(a.take_snapshot(), alloc::block_state::invalidated), 2u);
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_THROW((void)a.block_size(p), invalid_argument) << "a taken block is no live block";
  EXPECT_NO_THROW(a.record_stream(p, {})) << "recording a stream on a tombstone does nothing";
  // A storage's claim can come after a forced clear took its new block back:
  // it does nothing, and the late free is accepted as for any tombstone.
  EXPECT_NO_THROW(a.claim(p)) << "claiming a tombstone does nothing";
  EXPECT_NO_THROW(a.check_invariants()) << "a tombstone stays unclaimed";

  // All but the tombstones is free again, split around them.
  void* rest_of_p = r.allocate(mib - 512);
  void* rest_of_region = r.allocate(3 * mib - 512);
  EXPECT_EQ(rest_of_p, static_cast<char*>(p) + 512);
  EXPECT_EQ(rest_of_region, static_cast<char*>(q) + 512);
  a.deallocate(rest_of_p, {});
  a.deallocate(rest_of_region, {});
  a.deallocate(p, {});
  a.deallocate(q, {});
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 0) << "the late frees removed the tombstones";
  EXPECT_EQ(a.stats().invalidated_bytes.aggregate.current, 0);
  void* whole = r.allocate(4 * mib);
  EXPECT_EQ(whole, r.base) << "the region is one free block again";
  a.deallocate(whole, {});
  EXPECT_NO_THROW(a.check_invariants());
  a.destroy_private_pool(r.id);
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// After a forced clear the next owner is served from the same region; the
// old owner's free may come before or after the new owner's. Neither order
// may free the newer block or fail.
TYPED_TEST(forced_clear, a_late_free_never_frees_a_newer_block_at_the_same_address) {
  for (const bool newer_frees_first : {true, false}) {
    SCOPED_TRACE(newer_frees_first ? "the newer block's owner frees first" : "the stale owner frees first");
    auto& a = this->make();
    region_pool r(this->device(), a, 2 * mib);
    void* stale = r.allocate(mib);
    ASSERT_EQ(stale, r.base);
    (void)a.clear_private_pool(r.id, "", live_blocks::invalidate);
    void* newer = r.allocate(mib);
    EXPECT_NE(newer, stale) << "no newer block starts where a taken block did";
    if (newer_frees_first) {
      a.deallocate(newer, {});
      EXPECT_NO_THROW(a.deallocate(stale, {})) << "the late free finds its tombstone";
    } else {
      a.deallocate(stale, {});
      ASSERT_NO_THROW((void)a.block_size(newer)) << "the late free freed the newer block";
      EXPECT_EQ(a.stats().allocations.aggregate.current, 1);
      // Nothing handed out next overlaps the newer block.
      void* next = r.allocate(512 * kib);
      EXPECT_TRUE(static_cast<char*>(next) + 512 * kib <= newer || next >= static_cast<char*>(newer) + mib);
      a.deallocate(next, {});
      a.deallocate(newer, {});
    }
    EXPECT_NO_THROW(a.check_invariants());
    EXPECT_TRUE(nothing_in_use(a.stats()));
    EXPECT_EQ(a.stats().invalidated.aggregate.current, 0);
    a.destroy_private_pool(r.id);
  }
}

TYPED_TEST(forced_clear, a_late_free_after_the_region_went_back_is_accepted_and_frees_nothing) {
  auto& a = this->make();
  region_pool r(this->device(), a, 2 * mib);
  void* stale = r.allocate(mib);
  const auto taken = a.destroy_private_pool(r.id, live_blocks::invalidate);
  ASSERT_EQ(taken.blocks.size(), 1u);
  EXPECT_EQ(taken.blocks[0].address, reinterpret_cast<std::uintptr_t>(stale));
  const auto st = a.stats();
  EXPECT_TRUE(nothing_in_use(st));
  EXPECT_EQ(st.invalidated.aggregate.current, 0) << "the pool's stats went with it: " << st.to_json();
  EXPECT_EQ(st.reserved_bytes.aggregate.current, 0) << st.to_json();
  EXPECT_NO_THROW(a.record_stream(stale, {})) << "its owner's storage records its streams first";
  EXPECT_NO_THROW(a.deallocate(stale, {})) << "the late free of a taken block";
  EXPECT_THROW(a.deallocate(stale, {}), invalid_argument) << "a second free is an unknown pointer";
  r.id = a.create_private_pool(r.base, 2 * mib);
  void* whole = r.allocate(2 * mib);
  EXPECT_EQ(whole, r.base) << "the late free was owed no tombstone any more";
  a.deallocate(whole, {});
  EXPECT_NO_THROW(a.check_invariants());
  a.destroy_private_pool(r.id);
}

// The lender may lend the same memory again, and it may be adopted again
// before a taken block's owner frees it: the tombstone comes back with it.
TYPED_TEST(forced_clear, a_late_free_after_the_memory_was_inserted_again_frees_no_newer_block) {
  auto& a = this->make();
  region_pool r(this->device(), a, 2 * mib);
  void* stale = r.allocate(mib);
  ASSERT_EQ(stale, r.base);
  (void)a.destroy_private_pool(r.id, live_blocks::invalidate);
  r.id = a.create_private_pool(r.base, 2 * mib);
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 1) << "the tombstone came back";
  void* newer = r.allocate(mib);
  EXPECT_NE(newer, stale) << "a newer block starts where a taken block did";
  a.deallocate(stale, {});
  EXPECT_NO_THROW((void)a.block_size(newer)) << "the late free freed the newer block";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1);
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 0);
  a.deallocate(newer, {});
  void* whole = r.allocate(2 * mib);
  EXPECT_EQ(whole, r.base) << "the region is one free block again";
  a.deallocate(whole, {});
  EXPECT_NO_THROW(a.check_invariants());
  a.destroy_private_pool(r.id);
}

TYPED_TEST(forced_clear, a_region_with_tombstones_in_it_can_be_given_back) {
  auto& a = this->make();
  region_pool r(this->device(), a, 2 * mib);
  void* stale = r.allocate(mib);
  (void)a.clear_private_pool(r.id, "", live_blocks::invalidate);
  EXPECT_NO_THROW(a.destroy_private_pool(r.id)) << "a tombstone is no live block";
  EXPECT_EQ(a.stats().invalidated.aggregate.current, 0);
  EXPECT_NO_THROW(a.deallocate(stale, {})) << "its late free is still owed";
  EXPECT_NO_THROW(a.check_invariants());
}

// A side stream the allocator never heard of (no record_stream) still
// writes a live block: the clear returns only after it passed.
TYPED_TEST(forced_clear, waits_for_the_whole_device_before_taking_blocks_back) {
  struct counting : forwarding_device {
    using forwarding_device::forwarding_device;
    void synchronize_device() override {
      ++device_waits;
      forwarding_device::synchronize_device();
    }
    std::atomic<int> device_waits{0};
  } dev(this->device());
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(this->configured_text("")));
  region_pool r(dev, a, 2 * mib);
  backend::stream side(dev);
  void* p = r.allocate(mib);
  dev.delay(side, 300ms);
  dev.fill(side, p, 0x5A, mib);
  (void)a.clear_private_pool(r.id, "", live_blocks::invalidate);
  EXPECT_EQ(dev.device_waits.load(), this->debug ? 2 : 1) << "debug mode waits once more, for its poison";
  EXPECT_TRUE(dev.query(side)) << "the clear returned while a stream still wrote the block";
  a.deallocate(p, {});
  a.destroy_private_pool(r.id);
}

// A device implementation written before synchronize_device existed keeps
// the interface's default, which reports it unsupported: a forced clear or
// destroy is refused with that backend_error and changes nothing.
TYPED_TEST(forced_clear, is_refused_on_a_device_without_a_device_wide_wait) {
  struct without_device_wait : forwarding_device {
    using forwarding_device::forwarding_device;
    // What a device that does not override it gets.
    void synchronize_device() override { backend::device::synchronize_device(); }
  } dev(this->device());
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(this->configured_text("")));
  void* region = dev.allocate_segment(2 * mib);
  const auto pool = a.create_private_pool(region, 2 * mib);
  void* p = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    p = a.allocate(mib, {});
  }
  try {
    (void)a.clear_private_pool(pool, "", live_blocks::invalidate);
    ADD_FAILURE() << "a forced clear ran without a device-wide wait";
  } catch (const backend_error& e) {
    EXPECT_EQ(e.call(), "synchronize_device");
    EXPECT_NE(std::string(e.what()).find("does not implement a device-wide wait"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)a.destroy_private_pool(pool, live_blocks::invalidate), backend_error);
  const auto st = a.stats();
  EXPECT_EQ(st.allocations.aggregate.current, 1) << "nothing was taken: " << st.to_json();
  EXPECT_EQ(st.invalidated.aggregate.current, 0);
  EXPECT_EQ(a.block_size(p), mib) << "the block is still its owner's";
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, {});
  EXPECT_NO_THROW(a.clear_private_pool(pool)) << "the unforced clear needs no device-wide wait";
  EXPECT_NO_THROW(a.destroy_private_pool(pool));
  this->device().synchronize_device();  // debug poison may still be queued on it
  dev.free_segment(region);
}

TYPED_TEST(forced_clear, blocks_shared_with_another_process_refuse_it) {
  auto& a = this->make();
  region_pool r(this->device(), a, 2 * mib);
  void* shared = r.allocate(512 * kib);
  void* own = r.allocate(512 * kib);
  a.mark_held_outside(shared);
  try {
    (void)a.clear_private_pool(r.id, "", live_blocks::invalidate);
    ADD_FAILURE() << "a block another process holds was taken back";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(hex(shared)), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find(hex(own)), std::string::npos) << "names only the shared one: " << e.what();
  }
  EXPECT_THROW((void)a.destroy_private_pool(r.id, live_blocks::invalidate), invalid_argument);
  auto st = a.stats();
  EXPECT_EQ(st.allocations.aggregate.current, 2) << "nothing was taken: " << st.to_json();
  EXPECT_EQ(st.invalidated.aggregate.current, 0);
  EXPECT_NO_THROW((void)a.block_size(own));

  a.deallocate(shared, {});  // its holders let go: the mark goes with the free
  shared = r.allocate(512 * kib);  // the same block, handed out again, not shared
  const auto taken = a.clear_private_pool(r.id, "", live_blocks::invalidate);
  EXPECT_EQ(taken.blocks.size(), 2u);
  a.deallocate(shared, {});
  a.deallocate(own, {});
  a.destroy_private_pool(r.id);
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// The trace shows a taken block freed at the clear and its tombstone as a
// 512-byte block, allocated then and freed by the late free: every alloc
// has its free, in either order of free and pool destruction.
TEST(forced_clear_host, the_trace_frees_each_taken_block_and_each_tombstone_once) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("trace_entries:64"));
  void* region = dev.allocate_segment(2 * mib);
  auto pool = a.create_private_pool(region, 2 * mib);
  void* p = nullptr;
  void* q = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    p = a.allocate(256 * kib, {});
    q = a.allocate(128 * kib, {});
  }
  (void)a.clear_private_pool(pool, "", live_blocks::invalidate);
  a.deallocate(p, {});             // removes its tombstone
  a.destroy_private_pool(pool);    // q's tombstone outlives it as an orphan
  a.deallocate(q, {});             // the orphan's late free
  using alloc::trace_action;
  const auto addr = [](void* x) { return reinterpret_cast<std::uintptr_t>(x); };
  std::vector<std::pair<trace_action, std::size_t>> of_p, of_q;
  for (const auto& e : a.trace()) {
    if (e.address == addr(p)) of_p.emplace_back(e.action, e.size);
    if (e.address == addr(q)) of_q.emplace_back(e.action, e.size);
  }
  const auto expected = [](std::size_t size) {
    return std::vector<std::pair<trace_action, std::size_t>>{
        {trace_action::alloc, size},         {trace_action::free_requested, size}, {trace_action::free_completed, size},
        {trace_action::alloc, 512},          {trace_action::free_requested, 512},  {trace_action::free_completed, 512}};
  };
  EXPECT_EQ(of_p, expected(256 * kib));
  EXPECT_EQ(of_q, expected(128 * kib));
  dev.free_segment(region);
}

// Debug mode with cross-stream safety off keeps a cross-stream free's
// hazard event on the free block; a clear that resets the layout gives it
// back to the allocator's spare events (none is lost: each is destroyed).
TEST(forced_clear_host, a_reset_layout_gives_back_the_hazard_events_of_free_blocks) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  struct counting_events : forwarding_device {
    using forwarding_device::forwarding_device;
    backend::event_ref create_event() override {
      ++created;
      return forwarding_device::create_event();
    }
    void destroy_event(backend::event_ref e) override {
      ++destroyed;
      forwarding_device::destroy_event(e);
    }
    int created = 0, destroyed = 0;
  } dev(host);
  void* region = dev.allocate_segment(2 * mib);
  for (const live_blocks live : {live_blocks::refuse, live_blocks::invalidate}) {
    {
      alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true,cross_stream_safety:false"));
      backend::stream other(dev);
      auto pool = a.create_private_pool(region, 2 * mib);
      void* p = nullptr;
      void* keep = nullptr;
      {
        alloc::private_pool_scope scope(a, pool);
        p = a.allocate(256 * kib, {});
        keep = a.allocate(256 * kib, {});
      }
      a.deallocate(p, other);  // freed elsewhere: a hazard event on the free block
      if (live == live_blocks::refuse) a.deallocate(keep, {});
      a.drain_private_pool(pool);
      (void)a.clear_private_pool(pool, "", live);
      if (live == live_blocks::invalidate) a.deallocate(keep, {});
      a.destroy_private_pool(pool);
      dev.synchronize_device();
    }
    EXPECT_GT(dev.created, 0) << "no hazard event was recorded";
    EXPECT_EQ(dev.created, dev.destroyed) << "an event a clear dropped is never destroyed";
  }
  dev.free_segment(region);
}

// A device whose every fill starts late.
struct slow_fills : forwarding_device {
  using forwarding_device::forwarding_device;
  void fill(backend::stream_ref s, void* dst, std::uint8_t value, std::size_t bytes) override {
    forwarding_device::delay(s, 200ms);
    forwarding_device::fill(s, dst, value, bytes);
  }
};

// Debug mode poisons the blocks taken back; a newer block handed out on
// another stream is written after that fill, as after any free.
TEST(forced_clear_host, a_newer_block_on_another_stream_waits_for_the_poison_of_a_taken_block) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  slow_fills dev(host);
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true"));
  backend::stream first(dev), second(dev);
  region_pool r(dev, a, 2 * mib);
  void* stale = r.allocate(2 * mib, first);
  (void)a.clear_private_pool(r.id, "", live_blocks::invalidate);  // poisons `stale`
  auto* newer = static_cast<std::uint8_t*>(r.allocate(mib, second));
  const std::vector<std::uint8_t> pattern(mib, 0x22);
  host.copy(second, newer, pattern.data(), mib);
  host.synchronize(second);
  host.synchronize(first);
  std::vector<std::uint8_t> seen(mib);
  host.copy({}, seen.data(), newer, mib);
  host.synchronize({});
  EXPECT_TRUE(all_equal(seen, 0x22)) << "the poison fill overwrote the newer block's data";
  a.deallocate(newer, second);
  a.deallocate(stale, first);
  host.synchronize(first);
  host.synchronize(second);
  a.destroy_private_pool(r.id);
}

// The memory of a pool destroyed by force goes back to its owner when the
// call returns: the poison of its taken blocks must have been written.
TEST(forced_clear_host, a_forced_destroy_returns_only_after_the_poison_of_its_taken_blocks) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  slow_fills dev(host);
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true"));
  backend::stream s(dev);
  region_pool r(dev, a, 2 * mib);
  (void)r.allocate(mib, s);
  const auto taken = a.destroy_private_pool(r.id, live_blocks::invalidate);
  EXPECT_EQ(taken.blocks.size(), 1u);
  EXPECT_TRUE(dev.query({})) << "a poison fill was still queued on memory that left the allocator";
}

}  // namespace
}  // namespace shoal::testing
