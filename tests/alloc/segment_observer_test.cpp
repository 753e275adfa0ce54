// Segment observers (caching_allocator::add_segment_observer): every time the
// allocator takes memory from the device or gives it back, the observers are
// told what, where and how much, so a layer above (PyTorch's memory history)
// can follow the segments as the allocator's own trace does.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shoal/backend/stream.h"
#include "support/allocators.h"
#include "support/forwarding_device.h"
#include "support/sanitized.h"

namespace shoal::testing {
namespace {

constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Param>
using segment_observer = allocator_test<Param>;
TYPED_TEST_SUITE(segment_observer, backend_config_types, backend_config_names);

/// Records every event it is told of.
struct event_log {
  std::vector<alloc::segment_event> events;
  std::uint64_t id = 0;

  explicit event_log(alloc::caching_allocator& a)
      : id(a.add_segment_observer([this](const alloc::segment_event& e) { events.push_back(e); })) {}

  /// Bytes taken from the device less bytes given back.
  [[nodiscard]] std::int64_t held() const {
    std::int64_t sum = 0;
    for (const auto& e : events) {
      const bool takes = e.action == alloc::trace_action::segment_alloc || e.action == alloc::trace_action::segment_map;
      sum += takes ? static_cast<std::int64_t>(e.size) : -static_cast<std::int64_t>(e.size);
    }
    return sum;
  }

  /// The plain segments taken and not given back, by address.
  [[nodiscard]] std::map<std::uintptr_t, std::size_t> live_plain_segments() const {
    std::map<std::uintptr_t, std::size_t> live;
    for (const auto& e : events) {
      if (e.action == alloc::trace_action::segment_alloc) live[e.address] = e.size;
      if (e.action == alloc::trace_action::segment_free) live.erase(e.address);
    }
    return live;
  }
};

std::map<std::uintptr_t, std::size_t> plain_segments_of(const alloc::snapshot& s) {
  std::map<std::uintptr_t, std::size_t> out;
  for (const auto& seg : s.segments) {
    if (!seg.expandable) out[seg.address] = seg.size;
  }
  return out;
}

std::size_t mapped_growable_bytes(const alloc::snapshot& s) {
  std::size_t out = 0;
  for (const auto& seg : s.segments) out += seg.expandable ? seg.mapped_bytes : 0;
  return out;
}

// Over seeded random schedules on two streams (blocks of 512 B to 40 MiB,
// frees, now and then an empty cache), after every step: the events add up
// to the reserved bytes, the plain segments they leave live are the
// snapshot's, the growable stretches they leave mapped are its mapped bytes,
// and they are the segment entries of the allocator's own trace, in order.
TYPED_TEST(segment_observer, the_events_follow_every_segment_as_the_snapshot_and_the_trace_show_it) {
  auto& a = this->make("trace_entries:100000");
  event_log log(a);
  backend::stream first(this->device()), second(this->device());
  const backend::stream_ref streams[] = {first, second};
  for (std::uint32_t seed = 1; seed <= 3; ++seed) {
    std::mt19937 random(seed);
    std::vector<std::pair<void*, backend::stream_ref>> live;
    for (int step = 0; step < 120; ++step) {
      const auto choice = random() % 10;
      if (choice < 5 || live.empty()) {
        const std::size_t bytes = random() % 2 == 0 ? 512 + random() % (64 * kib) : mib + random() % (40 * mib);
        const backend::stream_ref on = streams[random() % 2];
        live.emplace_back(a.allocate(bytes, on), on);
      } else if (choice < 9) {
        const std::size_t i = random() % live.size();
        a.deallocate(live[i].first, live[i].second);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        this->device().synchronize(first);
        this->device().synchronize(second);
        a.empty_cache();
      }
      const std::string where = "seed " + std::to_string(seed) + ", step " + std::to_string(step);
      ASSERT_EQ(log.held(), a.stats().reserved_bytes.aggregate.current) << where;
      const alloc::snapshot snap = a.take_snapshot();
      ASSERT_EQ(log.live_plain_segments(), plain_segments_of(snap)) << where;
      ASSERT_EQ(static_cast<std::size_t>(log.held()) - [&] {
        std::size_t plain = 0;
        for (const auto& [address, size] : log.live_plain_segments()) plain += size;
        return plain;
      }(), mapped_growable_bytes(snap)) << where;
    }
    for (const auto& [p, on] : live) a.deallocate(p, on);
    this->device().synchronize(first);
    this->device().synchronize(second);
    a.empty_cache();
  }
  EXPECT_EQ(log.held(), a.stats().reserved_bytes.aggregate.current);
  std::vector<alloc::segment_event> traced;
  for (const alloc::trace_entry& e : a.trace()) {
    if (e.action != alloc::trace_action::alloc && e.action != alloc::trace_action::free_requested &&
        e.action != alloc::trace_action::free_completed && e.action != alloc::trace_action::oom) {
      traced.push_back({e.action, e.address, e.size, e.stream});
    }
  }
  ASSERT_EQ(traced.size(), log.events.size()) << "every segment entry of the trace, and no other event";
  for (std::size_t i = 0; i < traced.size(); ++i) {
    EXPECT_EQ(traced[i].action, log.events[i].action) << "event " << i;
    EXPECT_EQ(traced[i].address, log.events[i].address) << "event " << i;
    EXPECT_EQ(traced[i].size, log.events[i].size) << "event " << i;
    EXPECT_EQ(traced[i].stream, log.events[i].stream) << "event " << i;
  }
  EXPECT_FALSE(log.events.empty());
}

TYPED_TEST(segment_observer, an_event_names_the_stream_of_the_pool_that_grew) {
  auto& a = this->make();
  event_log log(a);
  backend::stream s(this->device());
  void* p = a.allocate(30 * mib, s);
  ASSERT_FALSE(log.events.empty());
  for (const auto& e : log.events) {
    EXPECT_EQ(e.stream, s.ref());
    EXPECT_EQ(e.action, TestFixture::expandable_segments ? alloc::trace_action::segment_map
                                                         : alloc::trace_action::segment_alloc);
  }
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  EXPECT_LE(log.events.back().address, at);
  EXPECT_GE(log.events.back().address + log.events.back().size, at + 30 * mib) << "the event covers the block";
  const std::size_t taken = log.events.size();
  a.deallocate(p, s);
  this->device().synchronize(s);
  a.empty_cache();
  ASSERT_GT(log.events.size(), taken);
  for (std::size_t i = taken; i < log.events.size(); ++i) {
    EXPECT_EQ(log.events[i].action, TestFixture::expandable_segments ? alloc::trace_action::segment_unmap
                                                                     : alloc::trace_action::segment_free);
    EXPECT_EQ(log.events[i].stream, s.ref());
  }
  EXPECT_EQ(log.held(), 0);
}

TYPED_TEST(segment_observer, a_removed_observer_is_told_nothing_and_a_throwing_one_harms_nothing) {
  auto& a = this->make();
  int removed_calls = 0, throwing_calls = 0;
  const auto removed = a.add_segment_observer([&](const alloc::segment_event&) { ++removed_calls; });
  (void)a.add_segment_observer([&](const alloc::segment_event&) {
    ++throwing_calls;
    throw std::runtime_error("an observer that fails");
  });
  event_log log(a);
  a.remove_hook(removed);
  void* p = nullptr;
  EXPECT_NO_THROW(p = a.allocate(30 * mib, {})) << "what an observer throws is dropped";
  EXPECT_EQ(removed_calls, 0);
  EXPECT_GT(throwing_calls, 0);
  EXPECT_EQ(log.held(), a.stats().reserved_bytes.aggregate.current) << "the observers after it are told too";
  a.deallocate(p, {});
  EXPECT_NO_THROW(a.empty_cache());
  EXPECT_EQ(log.held(), 0);
  a.check_invariants();
}

TYPED_TEST(segment_observer, a_destroyed_growing_pools_segments_are_told_given_back) {
  auto& a = this->make();
  event_log log(a);
  const auto pool = a.create_growing_private_pool();
  {
    alloc::private_pool_scope scope(a, pool);
    void* p = a.allocate(3 * mib, {});
    a.deallocate(p, {});
  }
  EXPECT_GT(log.held(), 0);
  this->device().synchronize({});
  a.destroy_private_pool(pool);
  EXPECT_EQ(log.held(), 0) << "every byte the pool took is told given back";
  EXPECT_EQ(log.held(), a.stats().reserved_bytes.aggregate.current);
}

// NCCL's per-pool buffer registration follows a pool's later segments by the
// pool their events name.
TYPED_TEST(segment_observer, an_event_names_the_growing_private_pool_whose_segment_it_is) {
  auto& a = this->make();
  event_log log(a);
  void* ordinary = a.allocate(3 * mib, {});
  const std::size_t ordinary_events = log.events.size();
  ASSERT_GT(ordinary_events, 0u);
  for (const auto& e : log.events) EXPECT_EQ(e.pool.value, 0u) << "the stream pools' segments name no pool";
  const auto first = a.create_growing_private_pool();
  const auto second = a.create_growing_private_pool();
  for (const auto pool : {first, second}) {
    alloc::private_pool_scope scope(a, pool);
    a.deallocate(a.allocate(30 * mib, {}), {});
  }
  this->device().synchronize({});
  a.destroy_private_pool(first);
  a.destroy_private_pool(second);
  std::map<std::uint64_t, std::int64_t> held_by;  // taken less given back, by pool
  for (std::size_t i = ordinary_events; i < log.events.size(); ++i) {
    const auto& e = log.events[i];
    const bool takes = e.action == alloc::trace_action::segment_alloc || e.action == alloc::trace_action::segment_map;
    held_by[e.pool.value] += takes ? static_cast<std::int64_t>(e.size) : -static_cast<std::int64_t>(e.size);
    EXPECT_TRUE(e.pool == first || e.pool == second) << "event " << i << " names pool " << e.pool.value;
  }
  EXPECT_EQ(held_by.count(first.value) + held_by.count(second.value), 2u) << "each pool's segments name it";
  EXPECT_EQ(held_by[first.value], 0) << "the destroyed pool's segments are told given back under its name";
  EXPECT_EQ(held_by[second.value], 0);
  a.deallocate(ordinary, {});
}

/// Knows which segments are given back to the device (until it hands the
/// address out again).
class freeing_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void* allocate_segment(std::size_t bytes) override {
    void* base = forwarding_device::allocate_segment(bytes);
    std::lock_guard lock(mutex_);
    freed_.erase(reinterpret_cast<std::uintptr_t>(base));
    return base;
  }
  void free_segment(void* base) override {
    forwarding_device::free_segment(base);
    std::lock_guard lock(mutex_);
    freed_.insert(reinterpret_cast<std::uintptr_t>(base));
  }
  bool freed(std::uintptr_t base) {
    std::lock_guard lock(mutex_);
    return freed_.count(base) != 0;
  }

 private:
  std::mutex mutex_;
  std::set<std::uintptr_t> freed_;
};

// A plain segment is told given back while the device still has not got it:
// once it has, it may give the address to another pool, whose segment_alloc
// must come after this segment_free.
TYPED_TEST(segment_observer, a_segment_is_told_given_back_before_the_device_has_it) {
  if (TestFixture::expandable_segments) GTEST_SKIP() << "plain segments";
  freeing_device dev(this->device());
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(TestFixture::configured_text("")));
  std::vector<std::pair<std::uintptr_t, bool>> told;  // a segment_free's base, and whether the device had it
  const auto id = a.add_segment_observer([&](const alloc::segment_event& e) {
    if (e.action == alloc::trace_action::segment_free) told.emplace_back(e.address, dev.freed(e.address));
  });
  for (const std::size_t bytes : {512 * kib, 3 * mib, 30 * mib}) {
    void* p = a.allocate(bytes, {});
    a.deallocate(p, {});
  }
  dev.synchronize({});
  a.empty_cache();
  ASSERT_EQ(told.size(), 3u);
  for (const auto& [base, device_had_it] : told) EXPECT_FALSE(device_had_it) << base;
  const auto pool = a.create_growing_private_pool();
  {
    alloc::private_pool_scope scope(a, pool);
    a.deallocate(a.allocate(3 * mib, {}), {});
  }
  dev.synchronize({});
  a.destroy_private_pool(pool);
  ASSERT_EQ(told.size(), 4u) << "a destroyed growing pool's segment";
  EXPECT_FALSE(told.back().second);
  a.remove_hook(id);
}

// Threads on their own streams take segments and give them back at once,
// so the device hands one thread's given-back address to another. In the
// order the observers are told: a plain segment's address is taken and given
// back in turn, never taken twice; a growable segment's granules are mapped
// and unmapped in turn. Fails when a segment is told given back only after
// the device has it back (another pool's segment_alloc of the address can
// come first).
TYPED_TEST(segment_observer, events_from_threads_come_in_an_order_that_can_be_replayed) {
  auto& a = this->make();
  std::mutex mutex;
  std::vector<alloc::segment_event> events;  // guarded by mutex
  const auto id = a.add_segment_observer([&](const alloc::segment_event& e) {
    std::lock_guard lock(mutex);
    events.push_back(e);
  });
  constexpr int threads = 4;
  // Debug's poison fills of every 1-25 MiB segment are most of its time; in
  // sanitized builds (24 s under TSan for 50 rounds) debug runs a quarter of
  // the rounds: 4 threads still take and give back 48 segments side by side.
  // The other configurations keep all 50 (about a second there).
  const int rounds = this->debug ? fewer_when_sanitized(50, 4) : 50;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      backend::stream own(this->device());
      std::mt19937 random(static_cast<std::uint32_t>(t + 1));
      for (int i = 0; i < rounds; ++i) {
        void* p = a.allocate(mib + random() % (24 * mib), own);
        a.deallocate(p, own);
        this->device().synchronize(own);
        a.empty_cache();
      }
    });
  }
  for (auto& w : workers) w.join();
  a.remove_hook(id);
  const std::size_t granule = this->device().granularity();
  std::set<std::uintptr_t> taken;  // plain segments' bases; growable granules
  for (std::size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    const bool plain = e.action == alloc::trace_action::segment_alloc || e.action == alloc::trace_action::segment_free;
    const bool takes = e.action == alloc::trace_action::segment_alloc || e.action == alloc::trace_action::segment_map;
    const std::size_t step = plain ? e.size : granule;
    for (std::uintptr_t at = e.address; at < e.address + e.size; at += step) {
      if (takes) {
        ASSERT_TRUE(taken.insert(at).second) << "event " << i << ": " << at << " taken again before it was given back";
      } else {
        ASSERT_EQ(taken.erase(at), 1u) << "event " << i << ": " << at << " given back but not taken";
      }
    }
  }
  EXPECT_TRUE(taken.empty()) << "every segment was given back";
}

// Observers come and go while other threads' segments come and go: a removed
// observer is never told anything after remove_hook returns.
TYPED_TEST(segment_observer, observers_come_and_go_while_events_fire) {
  auto& a = this->make();
  std::atomic<bool> done{false};
  std::thread worker([&] {
    backend::stream own(this->device());
    while (!done) {
      void* p = a.allocate(3 * mib, own);
      a.deallocate(p, own);
      this->device().synchronize(own);
      a.empty_cache();
    }
  });
  int told = 0;
  for (int i = 0; i < 200 || told == 0; ++i) {
    std::atomic<int> calls{0};
    const auto id = a.add_segment_observer([&](const alloc::segment_event&) { ++calls; });
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    a.remove_hook(id);
    const int at_removal = calls.load();
    std::this_thread::yield();
    ASSERT_EQ(calls.load(), at_removal) << "told after remove_hook returned";
    told += at_removal;
    ASSERT_LT(i, 20000) << "no observer was ever told anything";
  }
  done = true;
  worker.join();
  a.check_invariants();
}

}  // namespace
}  // namespace shoal::testing
