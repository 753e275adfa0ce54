// Free-wait observers (caching_allocator::add_free_wait_observer): a free
// that waits for streams is told `held` when it is called and `completed`
// when its wait is over, so a layer above (PyTorch's memory history) can
// record when the memory was free again, as PyTorch's free_completed does.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shoal/backend/stream.h"
#include "support/allocators.h"
#include "support/region_pool.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using held_or_completed = alloc::free_wait_event::action;
constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Param>
using free_wait_observer = allocator_test<Param>;
TYPED_TEST_SUITE(free_wait_observer, backend_config_types, backend_config_names);

/// Records every event it is told of.
struct wait_log {
  std::vector<alloc::free_wait_event> events;
  std::uint64_t id = 0;

  explicit wait_log(alloc::caching_allocator& a)
      : id(a.add_free_wait_observer([this](const alloc::free_wait_event& e) { events.push_back(e); })) {}

  /// The frees told held and not completed yet, by address (with their
  /// size); a completion never told held, or a block held twice, is a
  /// failure of the test.
  [[nodiscard]] std::map<std::uintptr_t, std::size_t> waiting() const {
    std::map<std::uintptr_t, std::size_t> out;
    for (const auto& e : events) {
      if (e.what == held_or_completed::held) {
        EXPECT_TRUE(out.emplace(e.address, e.size).second) << "held twice at " << e.address;
      } else {
        const auto found = out.find(e.address);
        EXPECT_TRUE(found != out.end() && found->second == e.size) << "completed, never held, at " << e.address;
        if (found != out.end()) out.erase(found);
      }
    }
    return out;
  }

  [[nodiscard]] std::size_t count(held_or_completed what) const {
    std::size_t n = 0;
    for (const auto& e : events) n += e.what == what ? 1 : 0;
    return n;
  }
};

/// The snapshot's blocks that wait for a stream, by address (with their size).
std::map<std::uintptr_t, std::size_t> pending_blocks(const alloc::snapshot& s) {
  std::map<std::uintptr_t, std::size_t> out;
  for (const auto& seg : s.segments) {
    for (const auto& b : seg.blocks) {
      if (b.state == alloc::block_state::pending_free) out[b.address] = b.size;
    }
  }
  return out;
}

TYPED_TEST(free_wait_observer, a_free_on_another_stream_is_told_held_then_completed_once_that_stream_passed) {
  auto& dev = this->device();
  auto& a = this->make();
  wait_log log(a);
  backend::stream mine(dev), other(dev);
  void* p = a.allocate(1000, mine);
  dev.delay(other, 300ms);
  a.deallocate(p, other);
  ASSERT_EQ(log.events.size(), 1u);
  const alloc::free_wait_event held = log.events[0];
  EXPECT_EQ(held.what, held_or_completed::held);
  EXPECT_EQ(held.address, reinterpret_cast<std::uintptr_t>(p));
  EXPECT_EQ(held.stream, mine.ref()) << "the block's own stream";
  EXPECT_EQ(log.waiting(), pending_blocks(a.take_snapshot()));
  a.process_pending_frees();
  EXPECT_EQ(log.events.size(), 1u) << "`other` has not passed the free yet";
  dev.synchronize(other);
  a.process_pending_frees();
  ASSERT_EQ(log.events.size(), 2u);
  EXPECT_EQ(log.events[1].what, held_or_completed::completed);
  EXPECT_EQ(log.events[1].address, held.address);
  EXPECT_EQ(log.events[1].size, held.size);
  EXPECT_EQ(log.events[1].stream, held.stream);
  EXPECT_TRUE(log.waiting().empty());
}

TYPED_TEST(free_wait_observer, a_free_that_waits_for_nothing_is_told_nothing) {
  auto& dev = this->device();
  auto& a = this->make();
  wait_log log(a);
  backend::stream mine(dev);
  for (const std::size_t bytes : {512 * std::size_t{1}, 64 * kib, 3 * mib}) a.deallocate(a.allocate(bytes, mine), mine);
  EXPECT_TRUE(log.events.empty());
}

TYPED_TEST(free_wait_observer, a_stream_named_by_record_stream_holds_a_free_on_the_blocks_own_stream) {
  auto& dev = this->device();
  auto& a = this->make();
  wait_log log(a);
  backend::stream mine(dev), other(dev);
  void* p = a.allocate(64 * kib, mine);
  dev.delay(other, 300ms);
  a.record_stream(p, other);
  a.deallocate(p, mine);
  ASSERT_EQ(log.events.size(), 1u);
  EXPECT_EQ(log.events[0].what, held_or_completed::held);
  dev.synchronize(other);
  a.process_pending_frees();
  ASSERT_EQ(log.events.size(), 2u);
  EXPECT_EQ(log.events[1].what, held_or_completed::completed);
  EXPECT_EQ(log.events[1].address, reinterpret_cast<std::uintptr_t>(p));
}

TYPED_TEST(free_wait_observer, a_block_reused_early_under_memory_pressure_is_told_completed) {
  auto& dev = this->device();
  auto& a = this->make("memory_limit_mb:2");  // one small segment, no more
  wait_log log(a);
  constexpr std::size_t half = 1024 * kib;
  backend::stream mine(dev), other(dev);
  void* p = a.allocate(half, mine);
  void* filler = a.allocate(half, mine);
  dev.delay(other, 300ms);
  a.deallocate(p, other);
  void* q = a.allocate(half, mine);  // `mine` waits for `other` on the device
  ASSERT_EQ(q, p);
  ASSERT_EQ(log.events.size(), 2u);
  EXPECT_EQ(log.events[1].what, held_or_completed::completed);
  EXPECT_EQ(log.events[1].address, reinterpret_cast<std::uintptr_t>(p));
  a.deallocate(q, mine);
  a.deallocate(filler, mine);
  dev.synchronize(other);
}

TYPED_TEST(free_wait_observer, a_forced_clear_completes_the_pools_waiting_frees) {
  auto& dev = this->device();
  auto& a = this->make();
  region_pool region(dev, a, 4 * mib);
  wait_log log(a);
  backend::stream mine(dev), other(dev);
  void* p = region.allocate(64 * kib, mine);
  dev.delay(other, 100ms);
  a.deallocate(p, other);
  ASSERT_EQ(log.waiting().size(), 1u);
  (void)a.clear_private_pool(region.id, "", alloc::live_blocks::invalidate);
  EXPECT_EQ(log.count(held_or_completed::completed), 1u);
  EXPECT_TRUE(log.waiting().empty());
  EXPECT_TRUE(pending_blocks(a.take_snapshot()).empty());
  (void)a.destroy_private_pool(region.id);
}

// Over seeded random schedules on three streams (delays on two of them,
// frees on any stream, record_stream now and then, allocations that find
// waits over, process_pending_frees, an empty cache), after every step the
// frees told held and not completed are exactly the snapshot's pending
// blocks: no block is handed out again, merged or given back before its
// completion is told, and none is told completed while it still waits.
TYPED_TEST(free_wait_observer, the_frees_told_waiting_are_the_snapshots_pending_blocks_over_random_schedules) {
  auto& dev = this->device();
  auto& a = this->make();
  wait_log log(a);
  backend::stream s0(dev), s1(dev), s2(dev);
  const backend::stream_ref streams[] = {s0, s1, s2};
  for (std::uint32_t seed = 1; seed <= 3; ++seed) {
    std::mt19937 random(seed);
    std::vector<std::pair<void*, backend::stream_ref>> live;
    for (int step = 0; step < 150; ++step) {
      const auto choice = random() % 20;
      if (choice < 8 || live.empty()) {
        const std::size_t bytes = random() % 3 != 0 ? 512 + random() % (64 * kib) : mib + random() % (6 * mib);
        const backend::stream_ref on = streams[random() % 3];
        live.emplace_back(a.allocate(bytes, on), on);
      } else if (choice < 15) {
        const std::size_t i = random() % live.size();
        a.deallocate(live[i].first, streams[random() % 3]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (choice < 17) {
        a.record_stream(live[random() % live.size()].first, streams[random() % 3]);
      } else if (choice < 18) {
        dev.delay(streams[1 + random() % 2], std::chrono::microseconds(random() % 3000));
      } else if (choice < 19) {
        a.process_pending_frees();
      } else {
        if (random() % 2 == 0) dev.synchronize(streams[random() % 3]);
        a.empty_cache();
      }
      const std::string where = "seed " + std::to_string(seed) + ", step " + std::to_string(step);
      ASSERT_EQ(log.waiting(), pending_blocks(a.take_snapshot())) << where;
    }
    for (const auto& [p, on] : live) a.deallocate(p, on);
    for (const auto s : streams) dev.synchronize(s);
    a.empty_cache();
    ASSERT_TRUE(log.waiting().empty()) << "seed " << seed << ": every wait told over";
  }
  EXPECT_GT(log.count(held_or_completed::held), 50u) << "the schedules made frees wait";
  EXPECT_EQ(log.count(held_or_completed::held), log.count(held_or_completed::completed));
}

// A cache-miss hook may free blocks (limbo collection does); a free that
// waits is told on the hook's thread, under the hold the hook runs with.
// (glibc's reader-preferring rwlock would tolerate a second hold too; a
// writer-preferring std::shared_mutex deadlocks on one while remove_hook
// waits, which is why the inner call takes none.)
TYPED_TEST(free_wait_observer, a_free_that_waits_made_by_a_cache_miss_hook_is_told) {
  auto& dev = this->device();
  auto& a = this->make();
  wait_log log(a);
  backend::stream mine(dev), other(dev);
  void* kept = a.allocate(64 * kib, mine);
  dev.delay(other, 100ms);
  void* freed_by_hook = nullptr;
  const auto hook = a.add_cache_miss_hook([&] {
    if (kept == nullptr) return;
    a.deallocate(kept, other);  // waits for `other`: told held, from inside the hook
    freed_by_hook = std::exchange(kept, nullptr);
  });
  void* grown = a.allocate(30 * mib, mine);  // misses the cache
  ASSERT_NE(freed_by_hook, nullptr) << "the hook ran";
  ASSERT_EQ(log.events.size(), 1u);
  EXPECT_EQ(log.events[0].what, held_or_completed::held);
  EXPECT_EQ(log.events[0].address, reinterpret_cast<std::uintptr_t>(freed_by_hook));
  a.remove_hook(hook);
  a.deallocate(grown, mine);
  dev.synchronize(other);
  a.process_pending_frees();
  EXPECT_EQ(log.count(held_or_completed::completed), 1u);
}

TYPED_TEST(free_wait_observer, a_removed_observer_is_told_nothing_and_a_throwing_one_harms_nothing) {
  auto& dev = this->device();
  auto& a = this->make();
  int removed_calls = 0, throwing_calls = 0;
  const auto removed = a.add_free_wait_observer([&](const alloc::free_wait_event&) { ++removed_calls; });
  (void)a.add_free_wait_observer([&](const alloc::free_wait_event&) {
    ++throwing_calls;
    throw std::runtime_error("an observer that fails");
  });
  wait_log log(a);
  a.remove_hook(removed);
  backend::stream mine(dev), other(dev);
  void* p = a.allocate(4 * kib, mine);
  dev.delay(other, 50ms);
  EXPECT_NO_THROW(a.deallocate(p, other)) << "what an observer throws is dropped";
  dev.synchronize(other);
  EXPECT_NO_THROW(a.process_pending_frees());
  EXPECT_EQ(removed_calls, 0);
  EXPECT_EQ(throwing_calls, 2);
  EXPECT_EQ(log.events.size(), 2u) << "the observers after it are told too";
  a.remove_hook(log.id);
  a.check_invariants();
}

}  // namespace
}  // namespace shoal::testing
