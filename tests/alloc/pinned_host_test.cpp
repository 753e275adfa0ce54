// The pinned host caching allocator (allocator_memory::pinned_host): blocks
// of page-locked host memory, handed out again only after every copy that
// read or wrote them has run, as seen from the host. On both backends.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/backends.h"
#include "support/forwarding_device.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
constexpr std::size_t kib = 1024, mib = kib * kib;

alloc::allocator_config pinned(std::string_view extra = "") {
  return alloc::allocator_config::parse("memory:pinned_host" + (extra.empty() ? "" : "," + std::string(extra)));
}

// Device memory the test copies into, returned at the end.
struct device_buffer {
  backend::device& dev;
  void* ptr;
  device_buffer(backend::device& d, std::size_t bytes) : dev(d), ptr(d.allocate_segment(bytes)) {}
  ~device_buffer() { dev.free_segment(ptr); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

template <class Backend>
using pinned_host_allocator = backend_test<Backend>;
TYPED_TEST_SUITE(pinned_host_allocator, backend_types, backend_names);

TYPED_TEST(pinned_host_allocator, a_block_freed_on_its_own_stream_waits_until_the_copy_from_it_has_run) {
  auto& dev = this->device();
  alloc::caching_allocator a(dev, pinned());
  stream s(dev);
  device_buffer dst(dev, 64 * kib);
  auto* p = static_cast<std::uint8_t*>(a.allocate(64 * kib, s));
  std::memset(p, 0x11, 64 * kib);
  dev.delay(s, 200ms);  // the copy below runs late
  dev.copy(s, dst.ptr, p, 64 * kib);
  a.deallocate(p, s);
  // The next batch's staging block, written by the CPU at once.
  auto* q = static_cast<std::uint8_t*>(a.allocate(64 * kib, s));
  EXPECT_NE(q, p) << "a pinned block was handed out again before the copy reading it had run";
  std::memset(q, 0x22, 64 * kib);
  EXPECT_TRUE(all_equal(this->read(dst.ptr, 64 * kib, s), 0x11)) << "the copy saw the next batch's bytes";
  a.deallocate(q, s);
  dev.synchronize(s);
  // Both are reusable once the copies have run: by the time the segment's
  // other blocks are taken, one of them comes back, and no segment is added.
  std::vector<void*> taken;
  while (taken.size() < 2 * mib / (64 * kib) + 1) {
    taken.push_back(a.allocate(64 * kib, s));
    if (taken.back() == p || taken.back() == q) break;
  }
  EXPECT_TRUE(taken.back() == p || taken.back() == q) << "a block stayed held after its copy had run";
  EXPECT_EQ(a.stats().device_allocations, 1);
  for (void* r : taken) a.deallocate(r, s);
  dev.synchronize(s);
}

// Counts the events recorded through it; refuses to record while asked to.
class recording_counter : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void record(backend::event_ref event, backend::stream_ref stream) override {
    if (refuse_records.load()) throw backend_error("event record", "refused by the test");
    records.fetch_add(1);
    forwarding_device::record(event, stream);
  }
  std::atomic<int> records{0};
  std::atomic<bool> refuse_records{false};
};

TYPED_TEST(pinned_host_allocator, small_frees_on_the_block_s_own_stream_share_one_event_and_are_still_held) {
  recording_counter dev(this->device());
  alloc::caching_allocator a(dev, pinned("memory_limit_mb:2"));  // one segment: 32 blocks of 64 KiB
  stream s(dev);
  device_buffer dst(dev, 31 * 64 * kib);  // a slice per copy
  dev.delay(s, 200ms);  // every copy below runs late
  for (int i = 0; i < 31; ++i) {  // 16 sealed at the 16th, 15 still awaiting
    auto* p = static_cast<std::uint8_t*>(a.allocate(64 * kib, s));
    std::memset(p, 0x40 + i, 64 * kib);
    dev.copy(s, static_cast<std::byte*>(dst.ptr) + i * 64 * kib, p, 64 * kib);
    a.deallocate(p, s);
    EXPECT_EQ(dev.records.load(), (i + 1) / 16) << "after free " << i + 1 << ": one event per 16 frees";
  }
  EXPECT_NO_THROW(a.check_invariants());
  void* last = a.allocate(64 * kib, s);  // the segment's last free block
  // The segment is full of held blocks: the next one comes only once the
  // copies reading them have run (the awaiting ones sealed first), and the
  // CPU's write cannot reach them.
  auto* next = static_cast<std::uint8_t*>(a.allocate(64 * kib, s));
  std::memset(next, 0x11, 64 * kib);
  const auto copied = this->read(dst.ptr, 31 * 64 * kib, s);
  for (int i = 0; i < 31; ++i) {
    EXPECT_TRUE(std::all_of(copied.begin() + i * 64 * kib, copied.begin() + (i + 1) * 64 * kib,
                            [&](auto byte) { return static_cast<int>(byte) == 0x40 + i; }))
        << "copy " << i << " saw bytes written after its block was handed out again";
  }
  EXPECT_EQ(dev.records.load(), 2) << "the awaiting frees were sealed when the allocation looked at them";
  a.deallocate(next, s);
  a.deallocate(last, s);  // awaiting
  dev.synchronize(s);
  a.process_pending_frees();
  a.empty_cache();
  EXPECT_EQ(dev.records.load(), 2) << "only calls on the pool's own stream seal (another may run after it is gone)";
  void* again = a.allocate(64 * kib, s);  // the sealed frees passed: one of them, no seal needed
  EXPECT_EQ(dev.records.load(), 2);
  EXPECT_NE(again, next) << "an awaiting free was handed out";
  EXPECT_NE(again, last) << "an awaiting free was handed out";
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_EQ(a.stats().device_allocations, 1);
  a.deallocate(again, s);
  dev.synchronize(s);
}

TYPED_TEST(pinned_host_allocator, a_refused_record_keeps_the_awaiting_frees_held_and_the_next_seal_reports_it) {
  recording_counter dev(this->device());
  alloc::caching_allocator a(dev, pinned("memory_limit_mb:2"));  // one segment: 32 blocks of 64 KiB
  stream s(dev);
  dev.refuse_records = true;
  std::vector<void*> freed;
  for (int i = 0; i < 16; ++i) {  // the 16th free seals, and its record is refused
    freed.push_back(a.allocate(64 * kib, s));
    a.deallocate(freed.back(), s);
  }
  EXPECT_EQ(dev.records.load(), 0);
  EXPECT_NO_THROW(a.check_invariants());
  std::vector<void*> taken;
  for (int i = 0; i < 16; ++i) {  // the segment's other blocks, never one still awaiting
    taken.push_back(a.allocate(64 * kib, s));
    EXPECT_EQ(std::count(freed.begin(), freed.end(), taken.back()), 0) << "a block with no event was handed out";
  }
  EXPECT_THROW((void)a.allocate(64 * kib, s), backend_error) << "the allocation that seals reports the refusal";
  EXPECT_NO_THROW(a.check_invariants());
  dev.refuse_records = false;
  void* again = a.allocate(64 * kib, s);  // sealed now, and waited for
  EXPECT_EQ(std::count(freed.begin(), freed.end(), again), 1);
  EXPECT_EQ(dev.records.load(), 1);
  EXPECT_EQ(a.stats().device_allocations, 1);
  taken.push_back(again);
  for (void* p : taken) a.deallocate(p, s);
  dev.synchronize(s);
  EXPECT_NO_THROW(a.check_invariants());
}

// Awaiting frees wait for an event that only their stream's next call would
// record: a destroyed stream makes none, so they are sealed when the
// allocator lets the stream go (destroyed_streams_test.cpp), and the memory
// goes back.
TYPED_TEST(pinned_host_allocator, awaiting_frees_of_a_destroyed_stream_are_sealed_when_it_is_let_go) {
  auto& dev = this->device();
  alloc::caching_allocator a(dev, pinned());
  stream s(dev);
  backend::stream_ref gone_ref;
  {
    stream gone(dev);
    gone_ref = gone.ref();
    a.deallocate(a.allocate(64 * kib, gone), gone);  // awaiting, no event
    dev.synchronize(gone);
  }
  EXPECT_NO_THROW(a.process_pending_frees());
  EXPECT_NO_THROW(a.empty_cache());
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "sealed, waited for and given back";
  EXPECT_THROW(dev.synchronize(gone_ref), invalid_argument) << "and the stream destroyed";
  void* p = nullptr;
  EXPECT_NO_THROW(p = a.allocate(64 * kib, s));
  a.deallocate(p, s);
  dev.synchronize(s);
  EXPECT_NO_THROW(a.check_invariants());
}

TYPED_TEST(pinned_host_allocator, large_frees_and_frees_on_other_streams_record_at_once) {
  recording_counter dev(this->device());
  alloc::caching_allocator a(dev, pinned());
  stream s(dev), other(dev);
  a.deallocate(a.allocate(mib, s), s);
  EXPECT_EQ(dev.records.load(), 1) << "1 MiB is enough to seal at once";
  a.deallocate(a.allocate(64 * kib, s), other);
  EXPECT_EQ(dev.records.load(), 3) << "a free on another stream: an event there and on the block's own";
  void* p = a.allocate(64 * kib, s);
  a.record_stream(p, other);
  a.deallocate(p, s);
  EXPECT_EQ(dev.records.load(), 5) << "record_stream: an event on each stream, at once";
  dev.synchronize(s);
  dev.synchronize(other);
  a.empty_cache();
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
}

// A pinned block freed on another stream: the next user writes it from the
// CPU, so the free waits for the work still queued on the block's own
// stream as well (record_stream cannot name that stream: it is the block's).
TYPED_TEST(pinned_host_allocator, a_free_on_another_stream_waits_for_the_blocks_own_stream_too) {
  auto& dev = this->device();
  alloc::caching_allocator a(dev, pinned());
  stream own(dev), other(dev);
  void* p = a.allocate(2 * mib, own);
  dev.delay(own, 200ms);
  dev.fill(own, p, 0xAA, 2 * mib);  // a write still queued on the block's own stream
  a.deallocate(p, other);           // `other` is idle: its event passes at once
  dev.synchronize(other);
  a.process_pending_frees();
  void* q = a.allocate(2 * mib, own);
  std::memset(q, 0x11, 2 * mib);  // the CPU stages the next batch
  dev.synchronize(own);
  EXPECT_EQ(static_cast<unsigned char*>(q)[0], 0x11) << "the old block's queued write landed on the new data";
  a.deallocate(q, own);
  dev.synchronize(own);
  EXPECT_NO_THROW(a.check_invariants());
}

TYPED_TEST(pinned_host_allocator, record_stream_makes_the_free_wait_for_that_stream_too) {
  auto& dev = this->device();
  alloc::caching_allocator a(dev, pinned());
  stream mine(dev), copier(dev);
  device_buffer dst(dev, 64 * kib);
  void* p = a.allocate(64 * kib, mine);
  std::memset(p, 0x33, 64 * kib);
  dev.delay(copier, 200ms);
  dev.copy(copier, dst.ptr, p, 64 * kib);
  a.record_stream(p, copier);
  a.deallocate(p, mine);
  void* q = a.allocate(64 * kib, mine);
  EXPECT_NE(q, p) << "handed out while the copying stream had not passed its copy";
  std::memset(q, 0x44, 64 * kib);
  EXPECT_TRUE(all_equal(this->read(dst.ptr, 64 * kib, copier), 0x33));
  a.deallocate(q, mine);
  dev.synchronize(mine);
}

TYPED_TEST(pinned_host_allocator, the_limit_bounds_the_footprint_and_allocation_waits_for_pending_copies) {
  auto& dev = this->device();
  alloc::caching_allocator a(dev, pinned("memory_limit_mb:4"));
  stream s(dev);
  device_buffer dst(dev, 3 * mib);
  void* p = a.allocate(3 * mib, s);
  std::memset(p, 0x55, 3 * mib);
  dev.delay(s, 200ms);
  dev.copy(s, dst.ptr, p, 3 * mib);
  a.deallocate(p, s);
  const auto start = std::chrono::steady_clock::now();
  void* q = a.allocate(3 * mib, s);  // no room for a second block: waits for the copy
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(q, p) << "the only block under the limit comes back once its copy has run";
  EXPECT_GE(waited, 100ms) << "handed out before the pending copy could have run";
  EXPECT_EQ(a.stats().device_frees, 0) << "gave the block's segment back only to take a new one";
  EXPECT_EQ(a.stats().device_allocations, 1);
  EXPECT_TRUE(all_equal(this->read(dst.ptr, 3 * mib, s), 0x55));
  EXPECT_LE(a.stats().reserved_bytes.aggregate.peak, std::int64_t{4 * mib});
  EXPECT_THROW((void)a.allocate(5 * mib, s), out_of_memory) << "one block past the limit fails";
  a.deallocate(q, s);
  dev.synchronize(s);
}

// A small block's free awaits its shared event in the small pool; a large
// block of the same stream at the limit needs that pool's segment back, so
// its wait seals and waits for the other size class's awaiting frees too
// (the transfer engine's ring of one chunk: a packed batch, then a chunked one).
TYPED_TEST(pinned_host_allocator, at_the_limit_a_large_block_waits_for_the_small_pools_awaiting_frees_too) {
  auto& dev = this->device();
  alloc::caching_allocator a(dev, pinned("memory_limit_mb:4"));
  stream s(dev);
  device_buffer dst(dev, 300 * kib);
  void* small = a.allocate(300 * kib, s);
  dev.delay(s, 100ms);
  dev.copy(s, dst.ptr, small, 300 * kib);
  a.deallocate(small, s);  // awaiting: under 1 MiB and 16 frees, no event yet
  ASSERT_EQ(a.stats().reserved_bytes.aggregate.current, std::int64_t{2 * mib}) << "the small pool's segment";
  void* large = nullptr;
  EXPECT_NO_THROW(large = a.allocate(4 * mib, s)) << "the small pool's free stayed awaiting, its segment reserved";
  EXPECT_LE(a.stats().reserved_bytes.aggregate.peak, std::int64_t{4 * mib});
  if (large != nullptr) a.deallocate(large, s);
  dev.synchronize(s);
}

// A staging ring at its limit: the next block needs only the oldest copy to
// have run. Waiting for every pending copy instead would drain the stream
// each time the ring wraps, and the CPU's staging would stop overlapping the
// device's copies. The stream is held behind a gate after the first copy, and
// the test opens the gate only once the allocation has returned: an allocator
// that waited for the later copies would hold the stream until the gate gives
// up, which the test reports. No upper bound on wall time is needed, so a
// loaded machine cannot fail it.
TYPED_TEST(pinned_host_allocator, at_the_limit_allocation_waits_for_the_oldest_pending_copy_only) {
  auto& dev = this->device();
  // Before the stream: they outlive the host task waiting on them, even
  // when an assertion ends the test before the gate opens.
  std::mutex gate_mutex;
  std::condition_variable gate_opened;
  bool open = false;
  std::atomic<bool> gate_gave_up{false};
  alloc::caching_allocator a(dev, pinned("memory_limit_mb:4"));
  stream s(dev);
  device_buffer dst(dev, 4 * mib);
  std::vector<void*> ring;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 4; ++i) {
    void* p = a.allocate(mib, s);
    std::memset(p, 0x60 + i, mib);
    if (i == 0) dev.delay(s, 150ms);
    dev.copy(s, static_cast<std::byte*>(dst.ptr) + i * mib, p, mib);
    a.deallocate(p, s);
    ring.push_back(p);
    if (i == 0) {
      dev.host_task(s, [&] {
        std::unique_lock lock(gate_mutex);
        if (!gate_opened.wait_for(lock, 10s, [&] { return open; })) gate_gave_up = true;
      });
    }
  }
  ASSERT_EQ(a.stats().reserved_bytes.aggregate.current, std::int64_t{4 * mib}) << "the ring fills the limit";
  void* next = a.allocate(mib, s);
  const auto returned = std::chrono::steady_clock::now() - t0;
  {
    std::lock_guard lock(gate_mutex);
    open = true;
  }
  gate_opened.notify_all();
  EXPECT_EQ(next, ring[0]) << "the block of the first copy, the one that has run";
  EXPECT_GE(returned, 149ms) << "handed out before its copy could have run";
  std::memset(next, 0x11, mib);
  const auto copied = this->read(dst.ptr, 4 * mib, s);
  EXPECT_FALSE(gate_gave_up) << "waited for the copies held behind the gate, not just the oldest";
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::all_of(copied.begin() + i * mib, copied.begin() + (i + 1) * mib,
                            [&](auto byte) { return static_cast<int>(byte) == 0x60 + i; }))
        << "copy " << i << " saw bytes written after its block was handed out again";
  }
  a.deallocate(next, s);
  dev.synchronize(s);
  EXPECT_NO_THROW(a.check_invariants());
}

TYPED_TEST(pinned_host_allocator, stats_count_pinned_memory_and_the_device_memory_is_untouched) {
  auto& dev = this->device();
  const auto device_free = dev.memory().free_bytes;
  {
    alloc::caching_allocator a(dev, pinned());
    stream s(dev);
    void* p = a.allocate(1 * mib, s);
    const auto stats = a.stats();
    EXPECT_EQ(stats.allocations.aggregate.current, 1);
    EXPECT_GE(stats.reserved_bytes.aggregate.current, std::int64_t{1 * mib});
    EXPECT_EQ(stats.device_allocations, 1);
    if (dev.kind() == backend::device_kind::host) EXPECT_EQ(dev.memory().free_bytes, device_free);
    a.deallocate(p, s);
    dev.synchronize(s);
    a.empty_cache();
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
    EXPECT_EQ(a.stats().device_frees, 1);
  }
}

TYPED_TEST(pinned_host_allocator, pinned_blocks_are_not_exported_to_other_processes) {
  auto& dev = this->device();
  alloc::caching_allocator a(dev, pinned());
  stream s(dev);
  void* p = a.allocate(4 * kib, s);
  EXPECT_THROW((void)dev.export_memory(p), error);
  a.deallocate(p, s);
  dev.synchronize(s);
}

TYPED_TEST(pinned_host_allocator, settings_that_do_not_apply_are_refused) {
  auto& dev = this->device();
  EXPECT_THROW(alloc::caching_allocator(dev, pinned("expandable_segments:true")), invalid_argument);
  EXPECT_THROW(alloc::caching_allocator(dev, pinned("memory_fraction:0.5")), invalid_argument);
  alloc::caching_allocator a(dev, pinned());
  EXPECT_THROW(a.set_memory_fraction(0.5), invalid_argument);
  EXPECT_THROW(dev.free_pinned_host(&dev), invalid_argument) << "a pointer allocate_pinned_host never returned";
}

TEST(pinned_host_config, the_memory_key_reads_back_and_rejects_other_values) {
  const auto c = alloc::allocator_config::parse("memory:pinned_host");
  EXPECT_EQ(c.memory, alloc::allocator_memory::pinned_host);
  EXPECT_EQ(alloc::allocator_config::parse(c.to_string()).memory, alloc::allocator_memory::pinned_host);
  EXPECT_EQ(alloc::allocator_config::parse("memory:device").memory, alloc::allocator_memory::device);
  EXPECT_THROW((void)alloc::allocator_config::parse("memory:managed"), invalid_argument);
}

// The control: device memory's rule (a block freed on its own stream is
// reusable at once) applied to memory the CPU writes corrupts the pending
// copy. The host backend's device memory is host memory, so the hazard the
// pinned rule prevents shows there for real.
TEST(pinned_host_control, without_the_host_side_hold_the_cpu_overwrites_a_pending_copy) {
  auto& dev = backend::host_device_instance();
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  stream s(dev);
  device_buffer dst(dev, 64 * kib);
  auto* p = static_cast<std::uint8_t*>(a.allocate(64 * kib, s));
  std::memset(p, 0x11, 64 * kib);
  dev.delay(s, 200ms);
  dev.copy(s, dst.ptr, p, 64 * kib);
  a.deallocate(p, s);
  auto* q = static_cast<std::uint8_t*>(a.allocate(64 * kib, s));
  ASSERT_EQ(q, p) << "the device rule hands the block out again at once";
  std::memset(q, 0x22, 64 * kib);
  std::vector<std::uint8_t> seen(64 * kib);
  dev.copy(s, seen.data(), dst.ptr, 64 * kib);
  dev.synchronize(s);
  EXPECT_TRUE(all_equal(seen, 0x22)) << "the pending copy read the next batch's bytes";
  a.deallocate(q, s);
  dev.synchronize(s);
}

}  // namespace
}  // namespace shoal::testing
