// Stream-ordered reuse: cross-stream frees, record_stream, the background
// transfer race, and debug mode, on every backend under every allocator
// configuration (default, expandable_segments, debug), each with
// cross-stream safety on and off. A test that holds in one mode only runs
// in that mode's configurations.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::event;
using backend::stream;
constexpr std::size_t kib = 1024, mib = kib * kib;

// What holds with cross-stream safety on and off.
template <class Backend>
using allocator_streams = allocator_test<Backend>;
TYPED_TEST_SUITE(allocator_streams, both_safety_config_types, backend_config_names);

// What the free-stream hold does: safety on.
template <class Backend>
using allocator_streams_safe = allocator_test<Backend>;
TYPED_TEST_SUITE(allocator_streams_safe, backend_config_types, backend_config_names);

// What happens without it: safety off.
template <class Backend>
using allocator_streams_unsafe = allocator_test<Backend>;
TYPED_TEST_SUITE(allocator_streams_unsafe, unsafe_config_types, backend_config_names);

// What happens when nothing catches the mistake: safety off and no debug,
// whose check throws ordering_violation instead
// (debug_mode_reports_a_hand_out_before_the_freeing_stream_passed).
template <class Backend>
using allocator_streams_unchecked = allocator_test<Backend>;
TYPED_TEST_SUITE(allocator_streams_unchecked, unsafe_unchecked_config_types, backend_config_names);

TYPED_TEST(allocator_streams, a_block_freed_on_its_own_stream_is_reusable_at_once) {
  auto& dev = this->device();
  auto& a = this->make();
  stream s(dev);
  void* p = a.allocate(64 * kib, s);
  dev.delay(s, 200ms);  // the stream is busy; its later work is ordered anyway
  a.deallocate(p, s);
  EXPECT_EQ(a.allocate(64 * kib, s), p);
  a.deallocate(p, s);
  dev.synchronize(s);
}

TYPED_TEST(allocator_streams_safe, a_block_freed_on_another_stream_waits_for_that_stream) {
  auto& dev = this->device();
  auto& a = this->make();
  stream mine(dev), other(dev);
  void* p = a.allocate(64 * kib, mine);
  dev.delay(other, 300ms);  // `other` still uses the block for a while
  a.deallocate(p, other);
  EXPECT_EQ(alloc::block_state::pending_free, this->allocator_->take_snapshot().segments[0].blocks[0].state);
  void* q = a.allocate(64 * kib, mine);
  EXPECT_NE(q, p) << "handed out while the freeing stream had not passed the free";
  dev.synchronize(other);
  a.process_pending_frees();
  void* r = a.allocate(64 * kib, mine);
  EXPECT_EQ(r, p) << "reusable once the freeing stream passed the free";
  a.deallocate(q, mine);
  a.deallocate(r, mine);
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// As PyTorch counts them: a block's requested bytes count while it is
// active, its free waiting for a stream included, and its snapshot keeps them.
TYPED_TEST(allocator_streams_safe, a_pending_free_keeps_its_requested_bytes_until_it_completes) {
  auto& dev = this->device();
  auto& a = this->make();
  stream mine(dev), other(dev);
  void* p = a.allocate(1000, mine);
  dev.delay(other, 300ms);
  a.deallocate(p, other);
  EXPECT_EQ(a.stats().requested_bytes.aggregate.current, 1000);
  EXPECT_EQ(a.stats().allocated_bytes.aggregate.current, 0);
  const auto pending = a.take_snapshot().segments[0].blocks[0];
  EXPECT_EQ(pending.state, alloc::block_state::pending_free);
  EXPECT_EQ(pending.requested, 1000u);
  a.check_invariants();
  dev.synchronize(other);
  a.process_pending_frees();
  EXPECT_EQ(a.stats().requested_bytes.aggregate.current, 0);
  EXPECT_EQ(a.take_snapshot().segments[0].blocks[0].requested, 0u);
  EXPECT_TRUE(nothing_in_use(a.stats()));
  a.check_invariants();
}

TYPED_TEST(allocator_streams_safe, free_defaults_to_the_threads_current_stream) {
  auto& dev = this->device();
  auto& a = this->make();
  stream mine(dev), other(dev);
  void* p = a.allocate(64 * kib, mine);
  dev.delay(other, 300ms);
  {
    backend::stream_guard on_other(dev, other);
    a.deallocate(p);  // no stream named: the current one, `other`
  }
  EXPECT_NE(a.allocate(64 * kib, mine), p);
  dev.synchronize(other);
  a.empty_cache();
}

TYPED_TEST(allocator_streams_safe, under_memory_pressure_a_pending_block_is_reused_through_a_device_wait) {
  auto& dev = this->device();
  auto& a = this->make("memory_limit_mb:2");  // one small segment, no more
  constexpr std::size_t half = 1024 * kib;
  stream mine(dev), other(dev);
  void* p = a.allocate(half, mine);
  void* filler = a.allocate(half, mine);  // the segment is full
  dev.fill(mine, p, 0x11, half);
  dev.delay(other, 300ms);
  dev.fill(other, p, 0x22, half);  // `other`'s last use, after its delay
  a.deallocate(p, other);
  void* q = a.allocate(half, mine);  // no room for more: `mine` waits for `other` on the device
  EXPECT_EQ(q, p);
  EXPECT_GE(a.stats().retries, 1);
  dev.fill(mine, q, 0x33, half);
  EXPECT_TRUE(all_equal(this->read(q, half, mine), 0x33)) << "`other`'s late fill overtook the new owner's write";
  a.deallocate(q, mine);
  a.deallocate(filler, mine);
}

// The race users of other allocators hit: a background thread copies a batch
// in on side stream S1; the model reads it on S0 and drops it while the read
// is still queued; the background thread's next allocation on S1 must not
// get the batch's memory before S0 has read it.
template <class Backend>
bool background_batch_survives(allocator_test<Backend>& t) {
  auto& dev = t.device();
  auto& a = t.make();
  stream s0(dev), s1(dev);
  constexpr std::size_t bytes = 256 * kib;
  void* seen = dev.allocate_segment(bytes);  // what the model read, checked at the end
  event batch_ready(dev);
  void* batch = nullptr;
  std::thread([&] {
    backend::stream_guard on_s1(dev, s1);
    batch = a.allocate(bytes);
    dev.fill(s1, batch, 0xB7, bytes);  // the transfer
    batch_ready.record(s1);
  }).join();
  {
    backend::stream_guard on_s0(dev, s0);
    dev.wait(s0, batch_ready);
    dev.delay(s0, 200ms);            // earlier model work
    dev.copy(s0, seen, batch, bytes);  // the model reads the batch
    a.deallocate(batch);             // and drops it, with the read still queued
  }
  std::thread([&] {
    backend::stream_guard on_s1(dev, s1);
    void* next = a.allocate(bytes);
    dev.fill(s1, next, 0x00, bytes);  // the next transfer
    dev.synchronize(s1);
    a.deallocate(next);
  }).join();
  dev.synchronize(s0);
  const bool intact = all_equal(t.read(seen, bytes), 0xB7);
  dev.free_segment(seen);
  return intact;
}

TYPED_TEST(allocator_streams_safe, the_background_transfer_race_is_prevented_by_default) {
  EXPECT_TRUE(background_batch_survives(*this));
}

// With safety off too: PyTorch's idiom (safety off, record_stream on).
TYPED_TEST(allocator_streams, record_stream_holds_the_free_for_that_stream_too) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream own(dev), other(dev);
  void* p = a.allocate(mib, own);
  dev.delay(other, std::chrono::milliseconds(100));
  dev.fill(other, p, 0x33, mib);  // a use on another stream, still queued
  a.record_stream(p, other);
  a.deallocate(p, own);
  void* q = a.allocate(mib, own);
  EXPECT_FALSE(dev.query(other)) << "the other stream finished too soon for the test to mean anything";
  EXPECT_NE(q, p) << "the block was handed out again while a recorded stream still used it";
  a.deallocate(q, own);
  other.synchronize();
  a.process_pending_frees();
  EXPECT_EQ(a.allocate(mib, own), p) << "once the recorded stream passed its use, the block is reusable";
}

TYPED_TEST(allocator_streams, an_allocator_destroyed_while_its_streams_still_work_on_its_blocks_waits_for_them) {
  auto& dev = this->device();
  backend::stream side(dev);
  {
    auto& a = this->make();
    void* p = a.allocate(1 << 20, side);
    dev.delay(side, std::chrono::milliseconds(30));
    dev.fill(side, p, 0x11, 1 << 20);  // the block's last use, still queued
    a.deallocate(p, side);             // (debug: the poison fill queues behind it)
    void* q = a.allocate(1 << 20, {});
    dev.delay({}, std::chrono::milliseconds(30));
    dev.fill({}, q, 0x22, 1 << 20);
    a.deallocate(q, side);  // a pending free: the default stream still writes it
    this->allocator_.reset();  // the memory goes only after both streams passed their uses
  }
  EXPECT_NO_THROW(side.synchronize());
  EXPECT_NO_THROW(dev.synchronize({}));
}

TYPED_TEST(allocator_streams_unchecked, the_background_transfer_race_corrupts_with_the_safety_off) {
  // Proves the test above can fail: without the hold the batch is overwritten.
  EXPECT_FALSE(background_batch_survives(*this));
}

TYPED_TEST(allocator_streams_safe, blocks_whose_cross_stream_frees_completed_are_reused_without_the_device) {
  auto& dev = this->device();
  auto& a = this->make();
  stream mine(dev), other(dev);
  // Two blocks that fill a small-pool segment, both freed on another stream.
  void* p = a.allocate(1 * mib, mine);
  void* q = a.allocate(1 * mib, mine);
  a.deallocate(p, other);
  a.deallocate(q, other);
  dev.synchronize(other);
  const auto before = a.stats();
  void* r = a.allocate(1 * mib, mine);  // the frees completed: both blocks are reusable now
  const auto after = a.stats();
  EXPECT_TRUE(r == p || r == q);
  EXPECT_EQ(after.device_allocations, before.device_allocations) << "took new memory while the cache could serve";
  EXPECT_EQ(after.device_frees, before.device_frees) << "gave a segment back only to take another";
  a.deallocate(r, mine);
}

TYPED_TEST(allocator_streams, debug_mode_poisons_reusable_blocks) {
  auto& dev = this->device();
  auto& a = this->make("debug:true");
  stream s(dev);
  void* p = a.allocate(64 * kib, s);
  dev.fill(s, p, 0x11, 64 * kib);
  a.deallocate(p, s);
  EXPECT_TRUE(all_equal(this->read(p, 64 * kib, s), 0xDB)) << "a freed block holds the poison pattern";
}

TYPED_TEST(allocator_streams_unsafe, debug_mode_reports_a_hand_out_before_the_freeing_stream_passed) {
  auto& dev = this->device();
  auto& a = this->make("debug:true");
  stream mine(dev), other(dev);
  void* p = a.allocate(64 * kib, mine);
  dev.delay(other, 300ms);
  a.deallocate(p, other);
  EXPECT_THROW((void)a.allocate(64 * kib, mine), ordering_violation);
  dev.synchronize(other);
  void* q = a.allocate(64 * kib, mine);
  EXPECT_EQ(q, p) << "once the stream passed, the block is fine to hand out";
  a.deallocate(q, mine);
}

}  // namespace
}  // namespace shoal::testing
