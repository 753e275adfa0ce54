// Streams their owners destroyed while the allocator held them: once
// nothing of the allocator needs them, their pools are made vacant with the
// memory they cached, the next new stream takes that cache over, and the
// stream is destroyed for real — at the next allocation off the cached pair
// when the stream is idle, or at empty_cache (which gives vacant pools'
// memory back). A stream per request no longer piles up held streams
// (threads on the host backend, cudaStream_t handles on CUDA), and each
// request's stream starts with the last one's cache.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"
#include "support/forwarding_device.h"
#include "support/region_pool.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

using backend::stream;
using namespace std::chrono_literals;
constexpr std::size_t mib = 1024 * 1024;

template <class Backend>
using destroyed_streams = allocator_test<Backend>;
TYPED_TEST_SUITE(destroyed_streams, backend_config_types, backend_config_names);

bool destroyed_for_real(backend::device& dev, backend::stream_ref s) {
  try {
    dev.synchronize(s);
    return false;
  } catch (const invalid_argument&) {
    return true;
  }
}

// A stream that had a block of `bytes` allocated and freed on it, its work
// waited for, then destroyed by its owner (deferred while the allocator
// holds it): its handle.
backend::stream_ref used_and_destroyed(backend::device& dev, alloc::caching_allocator& a, std::size_t bytes) {
  stream gone(dev);
  a.deallocate(a.allocate(bytes, gone), gone);
  dev.synchronize(gone);
  return gone.ref();
}

TYPED_TEST(destroyed_streams, an_idle_destroyed_stream_goes_at_the_next_allocation_and_leaves_it_its_cache) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref gone_ref = used_and_destroyed(dev, a, 4 * mib);
  EXPECT_FALSE(destroyed_for_real(dev, gone_ref)) << "held: its destroy waits";
  const auto before = a.stats();
  stream next(dev);
  void* p = a.allocate(4 * mib, next);  // next's first allocation: off the cached pair
  EXPECT_TRUE(destroyed_for_real(dev, gone_ref)) << "its pools were made vacant and the hold ended";
  const auto after = a.stats();
  EXPECT_EQ(after.reserved_bytes.aggregate.current, before.reserved_bytes.aggregate.current)
      << "the new stream took the destroyed one's cache over: nothing given back, nothing taken";
  EXPECT_EQ(after.device_allocations, before.device_allocations);
  EXPECT_EQ(after.device_frees, before.device_frees);
  for (const auto& s : a.take_snapshot().segments) EXPECT_EQ(s.stream, next.ref());
  EXPECT_EQ(after.allocations.aggregate.allocated, 2) << "the counts go on";
  EXPECT_EQ(after.allocations.aggregate.freed, 1);
  EXPECT_EQ(after.allocated_bytes.aggregate.peak, before.allocated_bytes.aggregate.peak);
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, next);
  dev.synchronize(next);
}

// Nothing takes a vacant pool's cache over yet: empty_cache gives it back.
TYPED_TEST(destroyed_streams, empty_cache_gives_a_vacant_pools_cache_back) {
  auto& dev = this->device();
  auto& a = this->make();
  stream mine(dev);
  void* p = a.allocate(mib, mine);
  (void)used_and_destroyed(dev, a, 4 * mib);
  std::thread([&] { a.deallocate(a.allocate(mib, mine), mine); }).join();  // off the cached pair: sweeps
  const auto held = a.stats().reserved_bytes.aggregate.current;
  a.empty_cache();
  const auto after = a.stats();
  EXPECT_LT(after.reserved_bytes.aggregate.current, held);
  for (const auto& s : a.take_snapshot().segments) EXPECT_EQ(s.stream, mine.ref()) << "only mine's live block is left";
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, mine);
  dev.synchronize(mine);
}

TYPED_TEST(destroyed_streams, a_destroyed_stream_whose_work_still_runs_waits_for_empty_cache) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream_ref gone_ref;
  {
    stream gone(dev);
    gone_ref = gone.ref();
    void* p = a.allocate(4 * mib, gone);
    dev.delay(gone, 300ms);
    dev.fill(gone, p, 0x5A, 4 * mib);
    a.deallocate(p, gone);
  }  // its fill still queued
  stream next(dev);
  void* q = a.allocate(mib, next);
  EXPECT_FALSE(destroyed_for_real(dev, gone_ref)) << "an allocation never waits for a destroyed stream's work";
  a.empty_cache();  // waits for it, gives its memory back
  EXPECT_TRUE(destroyed_for_real(dev, gone_ref));
  for (const auto& s : a.take_snapshot().segments) EXPECT_NE(s.stream, gone_ref);
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(q, next);
  dev.synchronize(next);
}

// Skipped while its work ran, a stream is looked at again after 16
// allocations off the cached pair, with no destroy or empty_cache to prompt it.
TYPED_TEST(destroyed_streams, a_stream_skipped_while_busy_is_let_go_by_a_later_allocation) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream_ref gone_ref;
  {
    stream gone(dev);
    gone_ref = gone.ref();
    a.deallocate(a.allocate(mib, gone), gone);
    dev.delay(gone, 200ms);
  }
  stream one(dev), two(dev);
  a.deallocate(a.allocate(mib, one), one);  // sweeps: gone is busy, skipped
  EXPECT_FALSE(destroyed_for_real(dev, gone_ref));
  while (!dev.query(gone_ref)) std::this_thread::sleep_for(5ms);  // held: still a stream to ask
  for (int i = 0; i < 16; ++i) {
    backend::stream_ref on = i % 2 == 0 ? two.ref() : one.ref();  // each a miss of the thread's last-pools entry
    a.deallocate(a.allocate(mib, on), on);
  }
  EXPECT_TRUE(destroyed_for_real(dev, gone_ref)) << "the retry came";
  dev.synchronize(one);
  dev.synchronize(two);
}

TYPED_TEST(destroyed_streams, a_destroyed_streams_pools_stay_while_a_block_of_it_lives) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream_ref gone_ref;
  void* p = nullptr;
  {
    stream gone(dev);
    gone_ref = gone.ref();
    p = a.allocate(4 * mib, gone);
    dev.synchronize(gone);
  }
  stream next(dev);
  void* q = a.allocate(mib, next);
  a.empty_cache();
  EXPECT_FALSE(destroyed_for_real(dev, gone_ref)) << "a block of it lives: its pool stays, and the stream";
  a.deallocate(p, gone_ref);  // freed on it: the hold keeps it usable for that
  a.empty_cache();
  EXPECT_TRUE(destroyed_for_real(dev, gone_ref)) << "its last block went: its pools were made vacant";
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(q, next);
  dev.synchronize(next);
}

// A thread's cache of its last stream's pools goes stale when they are made
// vacant: a new stream given the destroyed one's handle must not reach
// them, once they serve another stream.
TYPED_TEST(destroyed_streams, a_new_stream_on_a_let_go_streams_handle_never_takes_another_streams_pools) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref gone_ref = used_and_destroyed(dev, a, mib);  // this thread's last pools: gone's
  a.empty_cache();
  ASSERT_TRUE(destroyed_for_real(dev, gone_ref));
  stream other(dev);
  std::thread([&] { a.deallocate(a.allocate(mib, other), other); }).join();  // takes the vacant pools
  // Made and destroyed until one gets the handle (the host backend frees a
  // destroyed stream's memory at the next destroy).
  std::optional<stream> candidate;
  for (int i = 0; i < 16 && !(candidate && candidate->ref() == gone_ref); ++i) candidate.emplace(dev);
  if (candidate->ref() != gone_ref) GTEST_SKIP() << "the backend gave the destroyed stream's handle to no new stream";
  stream& reused = *candidate;
  void* p = a.allocate(mib, reused);  // this thread's cached pair path first
  const auto p_at = reinterpret_cast<std::uintptr_t>(p);
  bool found = false;
  for (const auto& s : a.take_snapshot().segments) {
    if (p_at - s.address >= s.size) continue;
    found = true;
    EXPECT_EQ(s.stream, reused.ref()) << "the block came from the pool of the stream it was asked on";
  }
  EXPECT_TRUE(found);
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, reused);
  dev.synchronize(reused);
  dev.synchronize(other);
}

// What a destroyed stream is still remembered by keeps it held: a private
// pool's block handed out on it (as its stream, then as its last stream once
// freed: the next hand-out waits for it), and a live block record_stream
// noted it on (its free records there).
TYPED_TEST(destroyed_streams, a_stream_a_private_pools_free_block_remembers_stays_held) {
  auto& dev = this->device();
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  backend::stream_ref gone_ref;
  {
    alloc::private_pool_scope scope(a, pool);
    gone_ref = used_and_destroyed(dev, a, mib);  // the free block remembers it
  }
  stream next(dev);
  void* q0 = a.allocate(mib, next);  // off the cached pair: sweeps
  a.empty_cache();
  EXPECT_FALSE(destroyed_for_real(dev, gone_ref)) << "a private pool's free block remembers it";
  void* q = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    EXPECT_NO_THROW(q = a.allocate(mib, next)) << "the hand-out waits for the remembered stream";
  }
  if (q != nullptr) a.deallocate(q, next);
  a.deallocate(q0, next);
  dev.synchronize(next);
  a.destroy_private_pool(pool);
}

TYPED_TEST(destroyed_streams, a_stream_a_live_private_block_was_handed_out_on_stays_held) {
  auto& dev = this->device();
  auto& a = this->make();
  const auto pool = a.create_growing_private_pool();
  backend::stream_ref gone_ref;
  void* p = nullptr;
  {
    stream gone(dev);
    gone_ref = gone.ref();
    alloc::private_pool_scope scope(a, pool);
    p = a.allocate(mib, gone);
    dev.synchronize(gone);
  }
  stream next(dev);
  void* q = a.allocate(mib, next);
  a.empty_cache();
  EXPECT_FALSE(destroyed_for_real(dev, gone_ref));
  EXPECT_NO_THROW(a.deallocate(p, gone_ref));
  a.deallocate(q, next);
  dev.synchronize(next);
  a.destroy_private_pool(pool);
}

TYPED_TEST(destroyed_streams, a_stream_recorded_on_a_live_block_stays_held_until_its_free) {
  auto& dev = this->device();
  auto& a = this->make();
  stream mine(dev);
  void* x = a.allocate(mib, mine);
  backend::stream_ref side_ref;
  {
    stream side(dev);
    side_ref = side.ref();
    a.deallocate(a.allocate(mib, side), side);  // side has pools: held
    a.record_stream(x, side);                   // x is used on side too
    dev.synchronize(side);
  }
  stream next(dev);
  void* y = a.allocate(mib, next);  // sweeps
  a.empty_cache();
  EXPECT_FALSE(destroyed_for_real(dev, side_ref)) << "x's free will record on it";
  EXPECT_NO_THROW(a.deallocate(x, mine)) << "the free records on side";
  a.empty_cache();
  EXPECT_TRUE(destroyed_for_real(dev, side_ref)) << "once x's free recorded there, side goes";
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(y, next);
  dev.synchronize(next);
  dev.synchronize(mine);
}

// After a stream was let go a thread's cache of its stream's pools works
// again at once: a cached pair (which never sweeps) still serves, so a stream
// destroyed meanwhile is still held after it.
TYPED_TEST(destroyed_streams, the_cached_pair_serves_again_after_a_stream_was_let_go) {
  auto& dev = this->device();
  auto& a = this->make();
  stream mine(dev);
  (void)used_and_destroyed(dev, a, mib);
  void* p = a.allocate(mib, mine);  // off the cached pair: sweeps, gone's pools are made vacant
  backend::stream_ref later_ref;
  {
    stream later(dev);
    later_ref = later.ref();
    std::thread([&] { a.deallocate(a.allocate(mib, later), later); }).join();  // this thread's cache stays on mine
    dev.synchronize(later);
  }
  a.deallocate(p, mine);
  p = a.allocate(mib, mine);  // the cached pair: no sweep
  EXPECT_FALSE(destroyed_for_real(dev, later_ref)) << "the pair went the general way: its cache entry never hit";
  a.deallocate(p, mine);
  a.empty_cache();
  EXPECT_TRUE(destroyed_for_real(dev, later_ref));
  dev.synchronize(mine);
}

// On CUDA a destroy returns at once and the stream's queued work runs
// later: a device whose destroys are buried until the test ends, and whose
// debug poison fills come late, shows work the sweep queued on a stream it
// let go landing in memory a new stream took over.
class late_destroying_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void fill(backend::stream_ref s, void* dst, std::uint8_t value, std::size_t bytes) override {
    if (value == poison) forwarding_device::delay(s, 200ms);
    forwarding_device::fill(s, dst, value, bytes);
  }
  void bury_the_destroyed() {
    std::lock_guard lock(mutex_);
    for (auto s : destroyed_) forwarding_device::destroy_stream_now(s);
    destroyed_.clear();
  }
  static constexpr std::uint8_t poison = 0xDB;  // debug mode's fill of freed memory

 protected:
  void destroy_stream_now(backend::stream_ref s) override {
    std::lock_guard lock(mutex_);
    destroyed_.push_back(s);
  }

 private:
  std::mutex mutex_;
  std::vector<backend::stream_ref> destroyed_;
};

// Writes `next`'s 4 MiB at `q`, waits for it and for whatever the streams
// let go had queued (late poison fills), and counts the 4 KiB pages whose
// first byte that poison overwrote.
int pages_poisoned_late(late_destroying_device& dev, stream& next, unsigned char* q) {
  dev.fill(next, q, 0x11, 4 * mib);
  dev.synchronize(next);
  std::this_thread::sleep_for(400ms);
  int poisoned = 0;
  for (std::size_t i = 0; i < 4 * mib; i += 4096) poisoned += q[i] == late_destroying_device::poison;
  return poisoned;
}

// Sweeps (an allocation on `other`, off the cached pair), then expects
// `gone` still held and a new stream's `bytes` (which would take its pools
// over, had they been made vacant) untouched by what was still queued.
void expect_kept_held_after_a_sweep(alloc::caching_allocator& a, late_destroying_device& dev, stream& other,
                                    backend::stream_ref gone, std::size_t bytes, const char* why) {
  a.deallocate(a.allocate(mib, other), other);
  EXPECT_TRUE(dev.stream_destroy_pending(gone)) << why;
  stream next(dev);
  auto* q = static_cast<unsigned char*>(a.allocate(bytes, next));
  EXPECT_EQ(pages_poisoned_late(dev, next, q), 0) << "next's data was overwritten: " << why;
  a.deallocate(q, next);
  dev.synchronize(next);
  dev.synchronize(other);
}

TEST(destroyed_streams_host, the_sweep_lets_a_stream_go_only_once_the_work_it_queued_there_ran) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  late_destroying_device dev(host);
  {
    alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true"));
    stream other(dev);
    {
      stream gone(dev);
      void* p = a.allocate(4 * mib, gone);
      dev.synchronize(gone);
      a.deallocate(p, other);  // pending on `other`'s event; collected by the sweep, which poisons it on `gone`
      dev.synchronize(other);
    }
    stream next(dev);
    // Sweeps: collecting the pending free queues its poison on `gone`, so
    // `gone` is busy again and stays held; `next` gets new memory.
    auto* q = static_cast<unsigned char*>(a.allocate(4 * mib, next));
    EXPECT_EQ(pages_poisoned_late(dev, next, q), 0)
        << "next's data was overwritten by a fill queued on the stream let go";
    a.deallocate(q, next);
    dev.synchronize(next);
    dev.synchronize(other);
  }
  dev.bury_the_destroyed();
}

// A free that comes while the sweep looks at a stream (another thread
// allocating and freeing on the destroyed stream, which stays usable while
// held) queues its debug poison there after the stream was found idle: the
// sweep must see the free counted and keep the stream, or the poison lands
// in memory the next stream took over. The free is made to come between the
// sweep's last idle query and its vacating: its only query when the pools
// hold nothing to quiesce, its second when they hold a pending free.
class query_hook_device : public late_destroying_device {
 public:
  using late_destroying_device::late_destroying_device;
  [[nodiscard]] bool query(backend::stream_ref s) override {
    const bool idle = late_destroying_device::query(s);
    if (idle && s == hooked_ && ++queries_ == hooked_query_) hook_();
    return idle;
  }
  void hook_query(backend::stream_ref s, int nth, std::function<void()> hook) {
    hooked_ = s;
    hooked_query_ = nth;
    hook_ = std::move(hook);
  }

 private:
  backend::stream_ref hooked_;
  int hooked_query_ = 0;
  int queries_ = 0;
  std::function<void()> hook_;
};

TEST(destroyed_streams_host, a_free_while_the_sweep_looks_at_a_stream_keeps_it_held) {
  for (const bool pending_free : {false, true}) {
    backend::host_device host({.capacity_bytes = 256 * mib});
    query_hook_device dev(host);
    {
      alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true"));
      // `other` has its pools before the sweep: a new stream's first
      // allocation would take over the pools the sweep made vacant, leaving
      // `next` below fresh memory the late poison cannot reach.
      stream other(dev);
      a.deallocate(a.allocate(mib, other), other);
      backend::stream_ref gone_ref;
      {
        stream gone(dev);
        gone_ref = gone.ref();
        // Its poison queued (late), then waited for; freed on `other`, the
        // block is pending (collected by the sweep, between its queries).
        a.deallocate(a.allocate(4 * mib, gone), pending_free ? other.ref() : gone.ref());
        dev.synchronize(gone);
        dev.synchronize(other);
      }
      dev.hook_query(gone_ref, pending_free ? 2 : 1, [&] {
        std::thread([&] { a.deallocate(a.allocate(4 * mib, gone_ref), gone_ref); }).join();
      });
      // `gone` is idle at the sweep's last query, but a free came after it.
      expect_kept_held_after_a_sweep(a, dev, other, gone_ref, 4 * mib, "a stream freed on meanwhile stays held");
    }
    dev.bury_the_destroyed();
  }
}

// Counts the queries of one stream.
class query_counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  [[nodiscard]] bool query(backend::stream_ref s) override {
    if (s == watched_) queries_.fetch_add(1);
    return forwarding_device::query(s);
  }
  void watch(backend::stream_ref s) { watched_ = s; }
  [[nodiscard]] int queries() const { return queries_.load(); }

 private:
  backend::stream_ref watched_;
  std::atomic<int> queries_{0};
};

// The sweep asks a destroyed stream whose pools hold nothing to quiesce
// once (a stream per request pays one query, not two), and one with a
// pending free twice: before it collects the free and after.
TEST(destroyed_streams_host, the_sweep_queries_a_stream_with_nothing_to_quiesce_once) {
  for (const bool pending_free : {false, true}) {
    backend::host_device host({.capacity_bytes = 256 * mib});
    query_counting_device dev(host);
    alloc::caching_allocator a(dev, {});
    stream other(dev);
    backend::stream_ref gone_ref;
    {
      stream gone(dev);
      gone_ref = gone.ref();
      a.deallocate(a.allocate(4 * mib, gone), pending_free ? other.ref() : gone.ref());  // on other: pending
      dev.synchronize(gone);
      dev.synchronize(other);
    }
    dev.watch(gone_ref);
    stream next(dev);
    a.deallocate(a.allocate(4 * mib, next), next);  // next's first allocation sweeps
    EXPECT_TRUE(destroyed_for_real(dev, gone_ref)) << "pending free: " << pending_free;
    EXPECT_EQ(dev.queries(), pending_free ? 2 : 1) << "pending free: " << pending_free;
    dev.synchronize(next);
  }
}

// Work queued on the held stream while the sweep looks at it: another
// thread allocates on it, queues a (late) write to the block and frees it
// (a common free, parked), right after the sweep's first query found the
// stream idle. Nothing of the pools is live, pending or awaiting then (no
// debug), and no free of the sweep's own queues anything: the sweep must
// still see the write (its last query, or the free counted) and keep the
// stream, or the write lands in memory the next stream took over.

TEST(destroyed_streams_host, work_queued_while_the_sweep_looks_at_a_stream_keeps_it_held) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  query_hook_device dev(host);
  {
    alloc::caching_allocator a(dev, {});  // no debug
    stream other(dev);
    a.deallocate(a.allocate(mib, other), other);
    backend::stream_ref gone_ref;
    {
      stream gone(dev);
      gone_ref = gone.ref();
      a.deallocate(a.allocate(4 * mib, gone), gone);
      dev.synchronize(gone);
    }
    dev.hook_query(gone_ref, 1, [&] {
      std::thread([&] {
        void* p = a.allocate(4 * mib, gone_ref);
        dev.fill(gone_ref, p, late_destroying_device::poison, 4 * mib);  // 200 ms late (the device's fill)
        a.deallocate(p, gone_ref);  // common free: parked, nothing queued by the allocator
      }).join();
    });
    expect_kept_held_after_a_sweep(a, dev, other, gone_ref, 4 * mib,
                                   "a stream with work queued after the sweep's first query stays held");
  }
  dev.bury_the_destroyed();
}

// The same with only the allocator's own work on the held stream: right
// after the sweep's first query, another thread frees gone's 20 MiB block
// on `x` (pending: x's last write to it is still queued), then allocates 20
// MiB on gone again at the device's capacity: allocate_slow's first step
// makes gone wait on the device for x's event (collect_pending(pool, true))
// and hands the block out again; it is freed (parked). gone must stay held
// while it waits for x, or `next` gets the block before x's write comes.
TEST(destroyed_streams_host, a_device_wait_queued_while_the_sweep_looks_at_a_stream_keeps_it_held) {
  backend::host_device host({.capacity_bytes = 32 * mib});
  query_hook_device dev(host);
  {
    alloc::caching_allocator a(dev, {});  // no debug, cross-stream safety on
    stream other(dev);
    stream x(dev);
    a.deallocate(a.allocate(mib, other), other);
    backend::stream_ref gone_ref;
    {
      stream gone(dev);
      gone_ref = gone.ref();
      a.deallocate(a.allocate(20 * mib, gone), gone);  // a 20 MiB segment: 22 of the 32 MiB taken
      dev.synchronize(gone);
    }
    dev.hook_query(gone_ref, 1, [&] {
      std::thread([&] {
        void* p = a.allocate(20 * mib, gone_ref);
        dev.fill(x, p, late_destroying_device::poison, 4 * mib);  // x's last use: 200 ms late
        a.deallocate(p, x);  // pending on x's event
        void* q = a.allocate(20 * mib, gone_ref);  // no room to grow: gone waits on the device for x
        EXPECT_EQ(q, p);
        a.deallocate(q, gone_ref);  // parked
      }).join();
    });
    expect_kept_held_after_a_sweep(a, dev, other, gone_ref, 20 * mib, "a stream waiting on the device for x stays held");
    dev.synchronize(x);
  }
  dev.bury_the_destroyed();
}

// A stream per request: the next stream's block of a size the last one
// freed is that parked block as it was (the pools went vacant without
// settling it). Settled, the segment's blocks would merge into one and the
// request be split off its start instead.
TEST(destroyed_streams_host, a_new_stream_takes_a_let_go_streams_parked_blocks_as_they_are) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, {});
  std::uintptr_t four_at = 0, eight_at = 0;
  {
    stream gone(dev);
    void* four = a.allocate(4 * mib, gone);
    void* eight = a.allocate(8 * mib, gone);  // one 20 MiB segment: 4, 8 and 8 free
    four_at = reinterpret_cast<std::uintptr_t>(four);
    eight_at = reinterpret_cast<std::uintptr_t>(eight);
    ASSERT_EQ(eight_at, four_at + 4 * mib);
    a.deallocate(four, gone);  // both parked
    a.deallocate(eight, gone);
    dev.synchronize(gone);
  }
  stream next(dev);
  void* p = a.allocate(8 * mib, next);  // sweeps, takes the vacant pools over
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p), eight_at) << "the parked 8 MiB block, not a split of the merged segment";
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, next);
  dev.synchronize(next);
}

// An out-of-memory report counts the parked blocks of a vacant pool (and of
// any pool) merged, as largest_free_block() does: a refusal with no host
// waits settles nothing first.
TEST(destroyed_streams_host, an_out_of_memory_report_counts_a_vacant_pools_parked_blocks_merged) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, {});
  std::size_t reported = 0;
  a.add_oom_observer([&](const alloc::oom_report& r) { reported = r.largest_free_block; });
  stream other(dev);
  a.deallocate(a.allocate(64 * 1024, other), other);
  {
    stream gone(dev);
    void* four = a.allocate(4 * mib, gone);
    void* eight = a.allocate(8 * mib, gone);  // one 20 MiB segment
    a.deallocate(four, gone);                 // both parked
    a.deallocate(eight, gone);
    dev.synchronize(gone);
  }
  a.deallocate(a.allocate(64 * 1024, other), other);  // off the cached pair: sweeps, gone's pools vacant
  ASSERT_EQ(a.largest_free_block(), 20 * mib);
  {
    alloc::no_host_waits_scope no_waits;
    EXPECT_THROW((void)a.allocate(50 * mib, other), out_of_memory);
  }
  EXPECT_EQ(reported, 20 * mib);
  EXPECT_NO_THROW(a.check_invariants());
  dev.synchronize(other);
}

TEST(destroyed_streams_host, a_retry_is_not_lost_to_allocations_in_a_no_host_waits_scope) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, {});
  backend::stream_ref gone_ref;
  {
    stream gone(dev);
    gone_ref = gone.ref();
    a.deallocate(a.allocate(mib, gone), gone);
    dev.delay(gone, 200ms);
  }
  stream one(dev), two(dev);
  a.deallocate(a.allocate(mib, one), one);  // sweeps: gone is busy, skipped
  while (!dev.query(gone_ref)) std::this_thread::sleep_for(5ms);
  {
    alloc::no_host_waits_scope no_waits;  // the retry would fall due in here: no sweep
    for (int i = 0; i < 32; ++i) {
      const backend::stream_ref on = i % 2 == 0 ? two.ref() : one.ref();
      a.deallocate(a.allocate(mib, on), on);
    }
  }
  EXPECT_FALSE(destroyed_for_real(dev, gone_ref)) << "no sweep in a no_host_waits_scope";
  for (int i = 0; i < 16; ++i) {  // the count to the retry goes on only where a sweep may run
    const backend::stream_ref on = i % 2 == 0 ? two.ref() : one.ref();
    a.deallocate(a.allocate(mib, on), on);
  }
  EXPECT_TRUE(destroyed_for_real(dev, gone_ref)) << "the retry was not lost";
  dev.synchronize(one);
  dev.synchronize(two);
}

TEST(destroyed_streams_host, empty_cache_gives_memory_back_before_it_reports_a_destroyed_streams_failed_work) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, {});
  stream mine(dev);
  a.deallocate(a.allocate(4 * mib, mine), mine);  // cached for `mine`
  dev.synchronize(mine);
  {
    stream gone(dev);
    void* p = a.allocate(mib, gone);
    dev.host_task(gone, [] { throw std::runtime_error("work failed"); });
    a.deallocate(p, gone);
  }
  EXPECT_THROW(a.empty_cache(), stream_error) << "the destroyed stream's failed work";
  for (const auto& s : a.take_snapshot().segments) {
    EXPECT_NE(s.stream, mine.ref()) << "mine's idle cache went back all the same";
  }
}

// A device whose queries of one stream fail (as cudaStreamQuery reports an
// error), until told otherwise.
class failing_query_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  [[nodiscard]] bool query(backend::stream_ref s) override {
    if (s == failing) throw backend_error("cudaStreamQuery", "an illegal memory access was encountered");
    return forwarding_device::query(s);
  }
  backend::stream_ref failing;
};

TEST(destroyed_streams_host, an_allocation_goes_on_past_a_failed_query_of_a_destroyed_stream) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  failing_query_device dev(host);
  alloc::caching_allocator a(dev, {});
  stream mine(dev);
  a.deallocate(a.allocate(mib, mine), mine);
  dev.failing = used_and_destroyed(dev, a, mib);
  // Off the cached pair: sweeps, and the query of the destroyed stream fails.
  void* q = nullptr;
  EXPECT_NO_THROW(q = a.allocate(mib, mine)) << "a failure of another stream's query is not this allocation's";
  a.deallocate(q, mine);
  EXPECT_TRUE(dev.stream_destroy_pending(dev.failing)) << "skipped, still held";
  const backend::stream_ref gone = dev.failing;
  dev.failing = {};
  EXPECT_NO_THROW(a.empty_cache());
  EXPECT_FALSE(dev.stream_destroy_pending(gone)) << "let go once its query answers";
  dev.synchronize(mine);
}

// The pile-up itself: one stream per request, each destroyed when its
// request is done. Counted on a device that knows how many of its streams
// are alive.
class stream_counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  backend::stream_ref create_stream() override {
    ++alive;
    return forwarding_device::create_stream();
  }
  std::atomic<int> alive{0};

 protected:
  void destroy_stream_now(backend::stream_ref s) override {
    forwarding_device::destroy_stream_now(s);
    --alive;
  }
};

TEST(destroyed_streams_host, a_stream_per_request_leaves_at_most_the_last_one_held) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  stream_counting_device dev(host);
  {
    alloc::caching_allocator a(dev, {});
    backend::stream_ref last;
    for (int request = 0; request < 64; ++request) {
      stream s(dev);
      last = s.ref();
      void* p = a.allocate(mib + static_cast<std::size_t>(request) * 4096, s);
      dev.fill(s, p, 1, mib);
      a.deallocate(p, s);
      dev.synchronize(s);
    }
    EXPECT_LE(dev.alive.load(), 1) << "every stream but the last was let go at the next request's allocation";
    for (const auto& seg : a.take_snapshot().segments) {
      EXPECT_EQ(seg.stream, last) << "each stream's cache passed on to the next";
    }
    EXPECT_EQ(a.stats().device_allocations, 2) << "one small segment (the first request's 1 MiB) and one large "
                                                   "served every request";
    EXPECT_NO_THROW(a.check_invariants());
  }
  EXPECT_EQ(dev.alive.load(), 0);
}

// A stream per request that only an owner's record_stream names (a transfer
// batch's storage waited on on it, a sent storage: the storage's release
// records its streams on the block, and the owner frees the block later, on
// its own stream), destroyed by its user before that free: the allocator
// holds it from the record_stream, the free records on it, and it goes then
// (it used to be destroyed at once, and the free then refused: the user had
// to keep every such stream for the allocator's life, a thread each here).
TEST(destroyed_streams_host, a_stream_per_request_only_recorded_on_a_block_goes_at_the_blocks_free) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  stream_counting_device dev(host);
  {
    alloc::caching_allocator a(dev, {});
    stream copies(dev);  // the owner's stream: every block is allocated and freed on it
    for (int request = 0; request < 64; ++request) {
      void* p = a.allocate(mib, copies);
      {
        stream s(dev);
        dev.fill(s, p, 1, mib);  // the request's use
        a.record_stream(p, s);   // its storage's release
      }  // the request's stream destroyed by its user, before the block's free
      EXPECT_LE(dev.alive.load(), 2) << "request " << request << ": only its stream is held, by its live block";
      ASSERT_NO_THROW(a.deallocate(p, copies)) << "the free records on the held stream";
      EXPECT_EQ(dev.alive.load(), 1) << "request " << request << ": its stream went at the free";
    }
    dev.synchronize(copies);
    a.empty_cache();
    EXPECT_EQ(a.stats().allocated_bytes.aggregate.current, 0);
    EXPECT_NO_THROW(a.check_invariants());
  }
  EXPECT_EQ(dev.alive.load(), 0);
}

// A restore frees a private pool's live blocks without a free call: the
// streams record_stream noted on them pass to the pool's held streams, and the
// record_stream's own hold must end there, or the stream outlives the allocator.
TEST(destroyed_streams_host, a_stream_recorded_on_a_block_a_restore_frees_goes_with_the_allocator) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  stream_counting_device dev(host);
  {
    alloc::caching_allocator a(dev, {});
    const auto pool = a.create_growing_private_pool();
    stream owner(dev);
    void* kept = nullptr;
    {
      alloc::private_pool_scope scope(a, pool);
      kept = a.allocate(mib, owner);
    }
    const auto checkpoint = a.checkpoint_private_pool(pool);
    {
      alloc::private_pool_scope scope(a, pool);
      void* p = a.allocate(mib, owner);
      {
        stream reader(dev);
        dev.fill(reader, p, 1, mib);
        a.record_stream(p, reader);
      }  // destroyed by its owner while the block lives
      (void)a.restore_private_pool(pool, checkpoint);  // frees p, remembering `reader`
    }
    a.deallocate(kept, owner);
    dev.synchronize(owner);
    EXPECT_NO_THROW(a.check_invariants());
  }
  EXPECT_EQ(dev.alive.load(), 0) << "a stream's hold outlived the allocator";
}

// A forced clear makes a live block a tombstone, which nothing waits on: the
// holds its record_stream took end there, and a stream its owner destroyed
// goes with them, not with the allocator.
TEST(destroyed_streams_host, a_stream_recorded_on_a_block_a_forced_clear_takes_goes_at_the_clear) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  stream_counting_device dev(host);
  alloc::caching_allocator a(dev, {});
  region_pool r(dev, a, 2 * mib);
  stream owner(dev);
  void* p = r.allocate(mib, owner);
  {
    stream reader(dev);
    dev.fill(reader, p, 1, mib);
    a.record_stream(p, reader);
  }  // destroyed by its owner while the block lives
  dev.synchronize_device();
  const int before = dev.alive.load();
  (void)a.clear_private_pool(r.id, "", alloc::live_blocks::invalidate);
  EXPECT_EQ(dev.alive.load(), before - 1) << "the reader's hold ended with the block";
  a.deallocate(p, owner);  // the tombstone's late free
  dev.synchronize(owner);
  EXPECT_NO_THROW(a.check_invariants());
}

// The free waits for the recorded stream's work though its owner destroyed
// it first: the block is not handed out again before that work ran.
TEST(destroyed_streams_host, a_block_recorded_on_a_destroyed_stream_waits_for_its_work) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  stream_counting_device dev(host);
  alloc::caching_allocator a(dev, {});
  stream copies(dev);
  void* p = a.allocate(mib, copies);
  std::atomic<bool> go{false};
  {
    stream s(dev);
    dev.host_task(s, [&] {
      while (!go.load()) std::this_thread::sleep_for(1ms);
    });
    dev.fill(s, p, 1, mib);
    a.record_stream(p, s);
  }
  EXPECT_EQ(dev.alive.load(), 2) << "held by the live block";
  a.deallocate(p, copies);
  EXPECT_EQ(dev.alive.load(), 1) << "destroyed at the free (its thread ends once its work ran)";
  void* q = a.allocate(mib, copies);
  EXPECT_NE(q, p) << "p waits for the destroyed stream's fill";
  go.store(true);
  a.deallocate(q, copies);
  dev.synchronize_device();
  dev.synchronize(copies);
  EXPECT_NO_THROW(a.check_invariants());
}

// Pinned host memory: the awaiting frees of a stream let go are sealed on it
// and waited for by the allocation's sweep, so the next new stream gets that
// memory at once, and the CPU may write it (nothing queued still reads it).
// The sweep an allocation runs may find no host memory (listing the
// streams, the scan of recorded streams, the vacant pools' place): the
// allocation goes on without it, and the streams it skipped are let go by a
// later sweep. Each heap allocation of such an allocation is refused in turn.
TEST(destroyed_streams_host, host_memory_refused_inside_a_sweep_fails_no_allocation_and_loses_no_stream) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  stream_counting_device dev(host);
  {
    alloc::caching_allocator a(dev, {});
    stream other(dev);
    a.deallocate(a.allocate(mib, other), other);  // other's pools and a cached block
    int refused_in_sweep_only = 0;
    int nth = 1;
    for (; nth < 200; ++nth) {
      {
        stream gone(dev);
        a.deallocate(a.allocate(mib, gone), gone);
        dev.synchronize(gone);
      }
      // Off the cached pair (the last stream was `gone`): sweeps for it.
      void* p = nullptr;
      bool refused = false;
      {
        const refusing_one_allocation refuse(nth, [] {});
        try {
          p = a.allocate(mib, other);
        } catch (const std::bad_alloc&) {
        }
        refused = refuse.refused();
      }
      if (p != nullptr) a.deallocate(p, other);
      if (refused && p != nullptr) ++refused_in_sweep_only;
      EXPECT_NO_THROW(a.check_invariants()) << "allocation " << nth << " refused";
      if (!refused) break;  // the allocation and its sweep made fewer than nth
      // Every round from the same state (a skipped stream would make the
      // next sweep allocate more): what this one skipped goes now.
      dev.synchronize(other);
      a.empty_cache();
      ASSERT_EQ(dev.alive.load(), 1) << "empty_cache let every destroyed stream go";
    }
    EXPECT_LT(nth, 200) << "the allocation stopped asking for memory";
    EXPECT_GT(refused_in_sweep_only, 0) << "a refusal inside the sweep failed the allocation";
    dev.synchronize(other);
    a.empty_cache();
    EXPECT_EQ(dev.alive.load(), 1) << "every destroyed stream was let go in the end; only `other` is alive";
    EXPECT_EQ(a.stats().allocated_bytes.aggregate.current, 0);
  }
}

// A new stream's pools refused host memory while vacant pools wait: the
// vacant ones stay vacant, their cache whole, for the next new stream.
TEST(destroyed_streams_host, a_vacant_pair_stays_vacant_when_a_new_streams_entry_finds_no_host_memory) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, {});
  stream mine(dev);
  a.deallocate(a.allocate(mib, mine), mine);  // mine's segment first: growing later would give gone's back
  const backend::stream_ref gone = used_and_destroyed(dev, a, 4 * mib);
  a.deallocate(a.allocate(mib, mine), mine);  // sweeps: gone's pools are vacant, its 4 MiB cached
  ASSERT_FALSE(dev.stream_destroy_pending(gone));
  ASSERT_EQ(a.stats().device_allocations, 2);
  const auto made = a.stats().device_allocations;
  int refusals = 0;
  for (int nth = 1; nth < 100; ++nth) {
    std::optional<stream> next_stream(std::in_place, dev);
    stream& next = *next_stream;
    void* p = nullptr;
    bool refused = false;
    {
      const refusing_one_allocation refuse(nth, [] {});
      try {
        p = a.allocate(4 * mib, next);
      } catch (const std::bad_alloc&) {
      }
      refused = refuse.refused();
    }
    EXPECT_NO_THROW(a.check_invariants()) << "allocation " << nth << " refused";
    if (p == nullptr) {
      ++refusals;
      p = a.allocate(4 * mib, next);  // the vacant cache is still there for it
    }
    EXPECT_EQ(a.stats().device_allocations, made) << "the vacant pair's cache served `next` after refusal " << nth;
    a.deallocate(p, next);
    dev.synchronize(next);
    const backend::stream_ref next_ref = next.ref();
    next_stream.reset();
    a.deallocate(a.allocate(mib, mine), mine);  // sweeps: next's pools vacant again, for the next round
    ASSERT_FALSE(dev.stream_destroy_pending(next_ref));
    if (!refused) break;
  }
  EXPECT_GT(refusals, 0) << "no allocation of the take-over was refused";
  dev.synchronize(mine);
}

TEST(destroyed_streams_host, a_new_stream_takes_over_a_let_go_streams_pinned_cache) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("memory:pinned_host"));
  void* first = nullptr;
  {
    stream gone(dev);
    first = a.allocate(64 * 1024, gone);
    a.deallocate(first, gone);  // awaiting: no event until the stream's next call (none will come)
    dev.synchronize(gone);
  }
  const auto before = a.stats();
  stream next(dev);
  void* p = a.allocate(64 * 1024, next);  // sweeps: seals on `gone`, waits, makes its pools vacant, takes them
  EXPECT_EQ(p, first) << "the let-go stream's block, handed out again";
  EXPECT_EQ(a.stats().device_allocations, before.device_allocations);
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, next);
  dev.synchronize(next);
}

// Streams made and destroyed on some threads while others allocate on their
// own streams, and stats, snapshots and empty_cache run beside them: the
// cumulative figures never go down, and at the end every stream made was
// destroyed and the cache is empty.
TEST(destroyed_streams_host, streams_come_and_go_while_other_threads_allocate_and_read_stats) {
  backend::host_device host({.capacity_bytes = 512 * mib});
  stream_counting_device dev(host);
  {
    alloc::caching_allocator a(dev, {});
    std::atomic<bool> stop{false};
    std::vector<std::thread> steady;
    for (int t = 0; t < 2; ++t) {
      steady.emplace_back([&] {
        stream mine(dev);
        while (!stop.load()) a.deallocate(a.allocate(256 * 1024, mine), mine);
        dev.synchronize(mine);
      });
    }
    std::thread watcher([&] {
      std::int64_t last_allocated = 0, last_peak = 0;
      while (!stop.load()) {
        std::this_thread::sleep_for(1ms);  // room for the others on a loaded machine (sanitizers, 2 cores)
        const auto st = a.stats();
        EXPECT_GE(st.allocations.aggregate.allocated, last_allocated);
        EXPECT_GE(st.reserved_bytes.aggregate.peak, last_peak);
        last_allocated = st.allocations.aggregate.allocated;
        last_peak = st.reserved_bytes.aggregate.peak;
        (void)a.take_snapshot();
        a.empty_cache();
        EXPECT_NO_THROW(a.check_invariants());
      }
    });
    std::vector<std::thread> churn;
    for (int t = 0; t < 2; ++t) {
      churn.emplace_back([&, t] {
        for (int i = 0; i < 60; ++i) {
          stream s(dev);
          void* p = a.allocate(mib * static_cast<std::size_t>(1 + (i + t) % 3), s);
          a.deallocate(a.allocate(4096, s), s);
          a.deallocate(p, s);
          if (i % 2 == 0) dev.synchronize(s);  // the others go destroyed with work queued
        }
      });
    }
    for (auto& th : churn) th.join();
    stop = true;
    for (auto& th : steady) th.join();
    watcher.join();
    a.empty_cache();
    EXPECT_EQ(dev.alive.load(), 0) << "every stream made was let go";
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
    EXPECT_NO_THROW(a.check_invariants());
  }
}

}  // namespace
}  // namespace shoal::testing
