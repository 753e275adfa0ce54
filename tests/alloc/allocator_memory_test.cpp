// Growable segments, out of memory, limits, private pools, and giving memory
// back while other streams grow.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"

namespace shoal::testing {
namespace {

constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Backend>
using allocator_memory = allocator_test<Backend>;
TYPED_TEST_SUITE(allocator_memory, backend_types, backend_names);

TYPED_TEST(allocator_memory, expandable_segments_grow_in_place_and_give_back_holes) {
  auto& a = this->make("expandable_segments:true");
  const std::size_t g = this->device().granularity();
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(a.allocate(10 * mib, {}));
  auto snap = a.take_snapshot();
  ASSERT_EQ(snap.segments.size(), 1u) << "one growable range for the pool";
  EXPECT_TRUE(snap.segments[0].expandable);
  EXPECT_EQ(static_cast<char*>(blocks[1]), static_cast<char*>(blocks[0]) + 10 * mib) << "grown in place";
  const auto reserved = a.stats().reserved_bytes.aggregate.current;
  EXPECT_EQ(reserved, static_cast<std::int64_t>((30 * mib + g - 1) / g * g));

  // Free the middle block: its whole chunks go back to the device though
  // both neighbours are still live.
  a.deallocate(blocks[1], {});
  a.empty_cache();
  const auto after = a.stats().reserved_bytes.aggregate.current;
  EXPECT_LE(after, reserved - static_cast<std::int64_t>(10 * mib - 2 * g));
  this->device().fill({}, blocks[0], 1, 10 * mib);
  this->device().fill({}, blocks[2], 2, 10 * mib);
  EXPECT_TRUE(all_equal(this->read(blocks[2], 10 * mib), 2)) << "the neighbours stay usable";

  // The hole is mapped again for the next request.
  blocks[1] = a.allocate(10 * mib, {});
  this->device().fill({}, blocks[1], 3, 10 * mib);
  EXPECT_TRUE(all_equal(this->read(blocks[1], 10 * mib), 3));
  for (void* b : blocks) a.deallocate(b, {});
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

TYPED_TEST(allocator_memory, a_pool_gives_its_idle_segments_back_before_it_grows) {
  for (const bool release : {true, false}) {
    auto& a = this->make(release ? "" : "release_idle_before_grow:false");
    a.deallocate(a.allocate(30 * mib, {}), {});  // a 30 MiB segment, cached and wholly free
    void* kept = a.allocate(40 * mib, {});       // does not fit in it: the pool grows
    const auto reserved = a.stats().reserved_bytes.aggregate.current;
    EXPECT_EQ(reserved, static_cast<std::int64_t>((release ? 40 : 70) * mib)) << "release_idle_before_grow " << release;
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.peak, static_cast<std::int64_t>((release ? 40 : 70) * mib));
    a.deallocate(kept, {});
  }
}

TYPED_TEST(allocator_memory, out_of_memory_names_the_free_block_of_the_pool_the_request_draws_from) {
  // 1 MiB comes from the small pool, which grows by 2 MiB segments: a free
  // 1 MiB block of the large pool could not serve it, and the message says so.
  auto& a = this->make("memory_limit_mb:4");
  void* big = a.allocate(3 * mib, {});  // a 4 MiB segment of the large pool: 1 MiB of it stays free
  try {
    (void)a.allocate(mib, {});
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the largest free cached block is 1048576 bytes, 0 in the small pool this request draws from "
                        "(as a block of 1048576 bytes)"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("expandable_segments:true"), std::string::npos) << "suggested where it is off: " << what;
  }
  a.deallocate(big, {});
}

TYPED_TEST(allocator_memory, out_of_memory_suggests_expandable_segments_only_where_they_are_off) {
  if (!this->device().growable().supported) GTEST_SKIP() << "no growable segments on this device";
  auto& a = this->make("memory_limit_mb:4,expandable_segments:true");
  void* big = a.allocate(3 * mib, {});
  try {
    (void)a.allocate(2 * mib, {});
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find("expandable_segments:true"), std::string::npos) << what;
  }
  a.deallocate(big, {});
}

TYPED_TEST(allocator_memory, a_memory_limit_fails_cleanly_and_frees_cache_before_failing) {
  auto& a = this->make("memory_limit_mb:40,release_idle_before_grow:false");  // the cache survives growth until memory runs out
  std::vector<alloc::oom_report> reports;
  a.add_oom_observer([&](const alloc::oom_report& r) { reports.push_back(r); });
  void* cached = a.allocate(12 * mib, {});
  a.deallocate(cached, {});  // 12 MiB segment stays cached
  void* big = a.allocate(36 * mib, {});  // only fits once the cache is given back
  EXPECT_GE(a.stats().retries, 1);
  try {
    (void)a.allocate(8 * mib, {});
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.requested_bytes(), 8 * mib);
    EXPECT_NE(what.find(std::to_string(8 * mib) + " bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("largest free cached block"), std::string::npos) << what;
    EXPECT_NE(what.find("limit"), std::string::npos) << what;
  }
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].requested_bytes, 8 * mib);
  EXPECT_EQ(reports[0].reserved_bytes, 36 * mib);
  EXPECT_EQ(reports[0].allocated_bytes, 36 * mib);
  EXPECT_EQ(reports[0].limit_bytes, 40 * mib);
  EXPECT_EQ(a.stats().ooms, 1);
  a.deallocate(big, {});
  void* after = a.allocate(8 * mib, {});  // the allocator is still fine
  a.deallocate(after, {});
}

// A removed observer is called no more and let go at once (what it holds
// goes with it); another keeps being called; an id is removed once.
TYPED_TEST(allocator_memory, a_removed_oom_observer_is_called_no_more_and_let_go) {
  auto& a = this->make("memory_limit_mb:4");
  int kept_calls = 0;
  int removed_calls = 0;
  const auto held = std::make_shared<int>(0);
  (void)a.add_oom_observer([&](const alloc::oom_report&) { ++kept_calls; });
  const std::uint64_t removed = a.add_oom_observer([&, held](const alloc::oom_report&) { ++removed_calls; });
  EXPECT_THROW((void)a.allocate(64 * mib, {}), out_of_memory);
  EXPECT_EQ(held.use_count(), 2);
  EXPECT_TRUE(a.remove_oom_observer(removed));
  EXPECT_EQ(held.use_count(), 1) << "the removed observer was kept";
  EXPECT_FALSE(a.remove_oom_observer(removed));
  EXPECT_THROW((void)a.allocate(64 * mib, {}), out_of_memory);
  EXPECT_EQ(kept_calls, 2);
  EXPECT_EQ(removed_calls, 1) << "called after its removal";
}

// An observer that allocates, and runs out of memory doing so, is not
// called again for that: it would recurse until the stack gave out.
TYPED_TEST(allocator_memory, an_out_of_memory_inside_an_oom_observer_does_not_call_it_again) {
  auto& a = this->make("memory_limit_mb:4");
  int calls = 0;
  a.add_oom_observer([&](const alloc::oom_report&) {
    if (++calls > 8) return;  // without the rule: 8 levels deep, then stop
    try {
      (void)a.allocate(64 * mib, {});
    } catch (const out_of_memory&) {  // NOLINT(bugprone-empty-catch): the observer's own attempt
    }
  });
  EXPECT_THROW((void)a.allocate(64 * mib, {}), out_of_memory);
  EXPECT_EQ(calls, 1);
  EXPECT_THROW((void)a.allocate(64 * mib, {}), out_of_memory);
  EXPECT_EQ(calls, 2) << "called again for the next allocation's out-of-memory";
}

// The trace ring is taken when the allocator is made: a count past the most
// kept is refused then, saying how much memory the most takes, instead of
// reserving gigabytes or failing with std::bad_alloc.
TYPED_TEST(allocator_memory, a_trace_ring_past_the_most_kept_is_refused_when_the_allocator_is_made) {
  alloc::allocator_config config;
  config.trace_entries = alloc::allocator_config::max_trace_entries + 1;
  try {
    alloc::caching_allocator refused(this->device(), config);
    FAIL() << "a ring of " << config.trace_entries << " records was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("trace_entries 16777217 is more than the most kept, 16777216"),
              std::string::npos)
        << e.what();
  }
  config.trace_entries = 1000;
  alloc::caching_allocator kept(this->device(), config);
  kept.deallocate(kept.allocate(512, {}), {});
  EXPECT_GE(kept.trace().size(), 2U) << "the allocation and its free traced";
}

// A limit under the least memory any allocation reserves would fail every
// allocation: refused when the allocator is made, in MiB and in bytes alike.
TYPED_TEST(allocator_memory, a_memory_limit_below_the_smallest_segment_is_refused_and_one_at_it_serves) {
  auto& dev = this->device();
  try {
    alloc::caching_allocator refused(dev, alloc::allocator_config::parse("memory_limit_mb:1"));
    FAIL() << "a 1 MiB limit was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("memory_limit_mb to at least 2"), std::string::npos) << e.what();
  }
  alloc::allocator_config bytes;
  bytes.memory_limit = alloc::allocator_config::smallest_reservation - 1;
  EXPECT_THROW(alloc::caching_allocator(dev, bytes), invalid_argument);
  auto& a = this->make("memory_limit_mb:2");
  a.deallocate(a.allocate(512 * 1024, {}), {});
  EXPECT_THROW((void)a.allocate(4 * mib, {}), out_of_memory);
}

// A max_split_size no larger than a large request's 20 MiB segment would
// leave the rest of each new segment oversize (kept whole, serving only
// requests within 1 MiB of it): refused, as PyTorch refuses it.
TYPED_TEST(allocator_memory, a_max_split_size_of_20_mib_or_less_is_refused_and_one_past_it_splits_segments) {
  try {
    alloc::caching_allocator refused(this->device(), alloc::allocator_config::parse("max_split_size_mb:20"));
    FAIL() << "max_split_size_mb:20 was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_split_size_mb 20 is not more than 20 MiB"), std::string::npos)
        << e.what();
  }
  auto& a = this->make("max_split_size_mb:21");
  void* p = a.allocate(2 * mib, {});
  void* q = a.allocate(2 * mib, {});
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(20 * mib))
      << "the second request is carved from the first one's segment";
  for (void* v : {p, q}) a.deallocate(v, {});
}

// A config built as a struct skips parse: a division count that is no power
// of two (3 rounded a 4097-byte request to 5460 bytes, and the next block
// started off the 512-byte grid) is refused by the allocator as by parse.
TYPED_TEST(allocator_memory, roundup_divisions_set_in_a_struct_are_checked_as_parse_checks_them) {
  alloc::allocator_config config;
  config.roundup_power2_divisions.fill(3);
  try {
    alloc::caching_allocator refused(this->device(), config);
    FAIL() << "roundup_power2_divisions 3 was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("roundup_power2_divisions 3 is not a power of two"), std::string::npos)
        << e.what();
  }
  config.roundup_power2_divisions.fill(128);
  EXPECT_THROW(alloc::caching_allocator(this->device(), config), invalid_argument);
  config.roundup_power2_divisions.fill(4);
  alloc::caching_allocator a(this->device(), config);
  void* p = a.allocate(4097, {});
  EXPECT_EQ(a.block_size(p) % 512, 0U);
  a.deallocate(p, {});
}

// A private pool's region is all it has: its blocks of max_split_size or
// more are split for smaller requests like any other.
TYPED_TEST(allocator_memory, a_private_pool_past_max_split_size_serves_small_requests) {
  auto& dev = this->device();
  auto& a = this->make("max_split_size_mb:32");
  auto* region = static_cast<char*>(dev.allocate_segment(64 * mib));
  const auto pool = a.create_private_pool(region, 64 * mib);
  void* p = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    p = a.allocate(mib, {});
  }
  EXPECT_EQ(p, region);
  a.deallocate(p, {});
  a.destroy_private_pool(pool);
  dev.free_segment(region);
}

// Under every allocator configuration.
template <class Param>
using allocator_memory_configured = allocator_test<Param>;
TYPED_TEST_SUITE(allocator_memory_configured, backend_config_types, backend_config_names);

// The host device under every configuration: its capacity can be set.
template <class Param>
using allocator_memory_host_pressure = allocator_test<Param>;
using host_config_types = ::testing::Types<host_default, host_expandable_segments, host_debug>;
TYPED_TEST_SUITE(allocator_memory_host_pressure, host_config_types, backend_config_names);

constexpr std::size_t six_point_four_mib = 6710886;  // takes a 20 MiB segment unless refused

// After the request that needed a right-sized segment: the memory is whole,
// usable and counted, and goes back when freed.
template <class Test>
void expect_served_in_reserved(Test& t, alloc::caching_allocator& a, void* held, void* p, std::size_t reserved) {
  t.device().fill({}, p, 0x64, six_point_four_mib);
  EXPECT_TRUE(all_equal(t.read(p, six_point_four_mib), 0x64));
  EXPECT_NO_THROW(a.check_invariants());
  const auto st = a.stats();
  EXPECT_EQ(st.reserved_bytes.aggregate.current, static_cast<std::int64_t>(reserved)) << st.to_json();
  EXPECT_EQ(st.allocations.pool[static_cast<std::size_t>(alloc::pool_kind::large)].current, 2);
  a.deallocate(p, {});
  a.deallocate(held, {});
  EXPECT_NO_THROW(a.check_invariants());
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
  EXPECT_NO_THROW(a.check_invariants());
}

TYPED_TEST(allocator_memory_configured, a_memory_limit_serves_a_request_it_has_room_for) {
  auto& a = this->make("memory_limit_mb:40");
  void* held = a.allocate(22 * mib, {});  // 22 of the 40 MiB reserved
  ASSERT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(22 * mib));
  void* p = nullptr;
  ASSERT_NO_THROW(p = a.allocate(six_point_four_mib, {})) << "18 MiB of the limit are left for a 6.4 MiB request";
  // A segment of the request's size rounded to 2 MiB (or, growable, the
  // chunks it needs): 22 + 8 MiB.
  expect_served_in_reserved(*this, a, held, p, 30 * mib);
  EXPECT_EQ(a.stats().ooms, 0);
}

TYPED_TEST(allocator_memory_host_pressure, a_device_that_refuses_the_standard_segment_still_serves_the_request) {
  backend::host_device dev({.capacity_bytes = 32 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(this->configured_text("")));
  void* held = a.allocate(22 * mib, {});  // 10 MiB of the device left: a 20 MiB segment is refused
  void* p = nullptr;
  ASSERT_NO_THROW(p = a.allocate(six_point_four_mib, {}));
  EXPECT_EQ(dev.memory().free_bytes, 2 * mib) << "an 8 MiB segment";
  dev.fill({}, p, 0x64, six_point_four_mib);
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(30 * mib));
  EXPECT_THROW((void)a.allocate(6 * mib, {}), out_of_memory) << "2 MiB of the device are left";
  a.deallocate(p, {});
  a.deallocate(held, {});
  a.empty_cache();
  EXPECT_EQ(dev.memory().free_bytes, 32 * mib);
  EXPECT_NO_THROW(a.check_invariants());
}

TYPED_TEST(allocator_memory_configured, a_right_sized_segment_does_not_bypass_giving_the_cache_back) {
  // 30 MiB cached in an idle segment of another stream's pool and 8 MiB in
  // use: only giving the cache back leaves room, even for a right-sized segment.
  auto& a = this->make("memory_limit_mb:40");
  backend::stream other(this->device());
  a.deallocate(a.allocate(30 * mib, other), other);
  void* held = a.allocate(8 * mib, {});
  void* p = nullptr;
  ASSERT_NO_THROW(p = a.allocate(six_point_four_mib, {}));
  EXPECT_GE(a.stats().retries, 1);
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, {});
  a.deallocate(held, {});
}

TYPED_TEST(allocator_memory, a_right_sized_segment_is_made_only_after_the_cache_is_given_back) {
  // 20 of the 30 MiB limit are cached idle in another stream's pool: a
  // right-sized 8 MiB segment would fit beside them, but giving them back
  // first leaves room for the standard 20 MiB segment, and nothing is kept
  // that no pool uses.
  auto& a = this->make("memory_limit_mb:30");
  backend::stream other(this->device());
  a.deallocate(a.allocate(six_point_four_mib, other), other);
  ASSERT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(20 * mib));
  void* p = a.allocate(six_point_four_mib, {});
  const auto st = a.stats();
  EXPECT_GE(st.retries, 1);
  EXPECT_EQ(st.reserved_bytes.aggregate.current, static_cast<std::int64_t>(20 * mib)) << st.to_json();
  EXPECT_EQ(st.segments.aggregate.current, 1) << st.to_json();
  const auto snap = a.take_snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].size, 20 * mib) << "the standard segment, not a right-sized one";
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, {});
}

TYPED_TEST(allocator_memory, a_private_pool_serves_scoped_allocations_from_its_region) {
  auto& dev = this->device();
  auto& a = this->make();
  auto* region = static_cast<char*>(dev.allocate_segment(8 * mib));
  const auto pool = a.create_private_pool(region, 8 * mib, {{"parameters", 6 * mib}, {"workspace", 2 * mib}});
  void* outside = a.allocate(mib, {});
  void *w1, *w2, *p1;
  {
    alloc::private_pool_scope scope(a, pool, "workspace");
    w1 = a.allocate(mib, {});
    w2 = a.allocate(mib, {});
    EXPECT_THROW((void)a.allocate(512, {}), out_of_memory) << "a private pool never grows";
    {
      alloc::private_pool_scope inner(a, pool, "parameters");
      p1 = a.allocate(5 * mib, {});
    }
  }
  EXPECT_EQ(w1, region + 6 * mib);
  EXPECT_EQ(w2, region + 7 * mib);
  EXPECT_EQ(p1, region);
  EXPECT_TRUE(outside < region || outside >= region + 8 * mib);
  EXPECT_THROW(a.clear_private_pool(pool, "workspace"), invalid_argument) << "blocks are live";
  a.deallocate(w1, {});
  a.deallocate(w2, {});
  a.clear_private_pool(pool, "workspace");
  {
    alloc::private_pool_scope scope(a, pool, "workspace");
    void* again = a.allocate(2 * mib, {});
    EXPECT_EQ(again, region + 6 * mib) << "cleared: one free block spanning the sub-pool";
    a.deallocate(again, {});
  }
  EXPECT_THROW(alloc::private_pool_scope(a, pool, "nope"), invalid_argument);
  EXPECT_THROW(a.destroy_private_pool(pool), invalid_argument) << "parameters still live";
  a.deallocate(p1, {});
  a.destroy_private_pool(pool);
  a.deallocate(outside, {});
  a.empty_cache();
  dev.free_segment(region);  // the caller's memory all along
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// A region the allocator manages already — another private pool's, or a
// block of one of its segments — is refused: both would hand the same bytes
// out. A region right beside one is not.
TYPED_TEST(allocator_memory, a_private_pool_over_memory_the_allocator_manages_is_refused) {
  auto& dev = this->device();
  auto& a = this->make();
  auto* region = static_cast<char*>(dev.allocate_segment(8 * mib));
  const auto first = a.create_private_pool(region, 4 * mib);
  for (char* start : {region, region + 2 * mib}) {
    try {
      (void)a.create_private_pool(start, 4 * mib);
      ADD_FAILURE() << "a region overlapping another pool's was accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("overlaps memory this allocator manages already"), std::string::npos)
          << e.what();
    }
  }
  const auto beside = a.create_private_pool(region + 4 * mib, 4 * mib);
  // Ranges that wrap past the end of memory would pass any overlap check.
  EXPECT_THROW((void)a.create_private_pool(reinterpret_cast<void*>(UINTPTR_MAX - 511), 1024), invalid_argument);
  EXPECT_THROW((void)a.create_private_pool(region, 4 * mib, {{"a", 2 * mib}, {"b", SIZE_MAX - 511}}),
               invalid_argument);
  void* block = a.allocate(4 * mib, {});
  EXPECT_THROW((void)a.create_private_pool(block, mib), invalid_argument) << "a region inside a live block";
  void* after = a.allocate(4 * mib, {});
  a.check_invariants();
  for (void* p : {block, after}) a.deallocate(p, {});
  a.destroy_private_pool(beside);
  a.destroy_private_pool(first);
  a.empty_cache();
  dev.free_segment(region);
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// Destroyed private pools' bookkeeping serves the next one (inserting a
// region again costs no new pages): nothing of the old pool may show.
TYPED_TEST(allocator_memory, a_region_inserted_again_after_destroy_starts_from_a_clean_pool) {
  auto& dev = this->device();
  auto& a = this->make();
  auto* region = static_cast<char*>(dev.allocate_segment(8 * mib));
  const auto first = a.create_private_pool(region, 8 * mib, {{"parameters", 6 * mib}, {"workspace", 2 * mib}});
  void* freed_early = nullptr;
  {
    alloc::private_pool_scope scope(a, first, "workspace");
    freed_early = a.allocate(mib, {});
    void* kept = a.allocate(512 * 1024, {});
    a.deallocate(freed_early, {});  // split blocks, merged again on free
    a.deallocate(kept, {});
  }
  a.destroy_private_pool(first);
  EXPECT_THROW(alloc::private_pool_scope(a, first, "workspace"), invalid_argument) << "its id is gone";

  const auto second = a.create_private_pool(region + 2 * mib, 4 * mib, {{"", 4 * mib}});
  auto st = a.stats();
  EXPECT_EQ(st.reserved_bytes.aggregate.current, static_cast<std::int64_t>(4 * mib)) << st.to_json();
  EXPECT_EQ(st.segments.aggregate.current, 1) << st.to_json();
  EXPECT_EQ(st.inactive_split.aggregate.current, 0) << st.to_json();
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_THROW(a.deallocate(region + 6 * mib, {}), invalid_argument) << "a block of the destroyed pool";
  {
    alloc::private_pool_scope scope(a, second);
    void* whole = a.allocate(4 * mib, {});
    EXPECT_EQ(whole, region + 2 * mib) << "one free block spanning the new region, none of the old one's";
    EXPECT_THROW((void)a.allocate(512, {}), out_of_memory) << "nothing of the old region is free in it";
    a.deallocate(whole, {});
  }
  EXPECT_NO_THROW(a.check_invariants());
  a.destroy_private_pool(second);
  a.empty_cache();
  dev.free_segment(region);
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// A scope that outlives its pool directs to a sub-pool object that a later
// private pool may serve from: its allocations are refused, never handed
// out of the later pool (nor of the emptied one).
TYPED_TEST(allocator_memory, a_scope_that_outlived_its_pool_is_refused_even_once_the_sub_pool_serves_another) {
  auto& dev = this->device();
  auto& a = this->make();
  auto* region = static_cast<char*>(dev.allocate_segment(4 * mib));
  const auto first = a.create_private_pool(region, 2 * mib);
  {
    alloc::private_pool_scope stale(a, first);
    a.deallocate(a.allocate(mib, {}), {});
    a.destroy_private_pool(first);
    EXPECT_THROW((void)a.allocate(mib, {}), invalid_argument) << "its pool is gone";
    // The destroyed pool's sub-pool object serves the next pool.
    const auto second = a.create_private_pool(region + 2 * mib, 2 * mib);
    EXPECT_THROW((void)a.allocate(mib, {}), invalid_argument) << "a later pool is not the scope's";
    {
      alloc::private_pool_scope fresh(a, second);
      void* p = a.allocate(mib, {});
      EXPECT_EQ(p, region + 2 * mib) << "a scope of the later pool allocates from it";
      a.deallocate(p, {});
    }
    EXPECT_THROW((void)a.allocate(mib, {}), invalid_argument) << "the inner scope's end restored the stale one";
    EXPECT_EQ(a.private_pool_allocated_blocks(second).size(), 0U);
    a.destroy_private_pool(second);
  }
  void* outside = a.allocate(mib, {});  // the stale scope ended: stream pools serve again
  EXPECT_TRUE(outside < region || outside >= region + 4 * mib);
  a.deallocate(outside, {});
  EXPECT_NO_THROW(a.check_invariants());
  a.empty_cache();
  dev.free_segment(region);
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

TYPED_TEST(allocator_memory, a_private_pool_block_moving_to_another_stream_waits_for_the_last_one) {
  using namespace std::chrono_literals;
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream first(dev), second(dev);
  void* region = dev.allocate_segment(2 * mib);
  const auto pool = a.create_private_pool(region, 2 * mib);
  {
    alloc::private_pool_scope scope(a, pool);
    void* p = a.allocate(mib, first);
    dev.delay(first, 200ms);
    dev.fill(first, p, 0x11, mib);  // the first stream's last use, still queued
    a.deallocate(p, first);
    void* q = a.allocate(mib, second);  // the same memory, now for `second`
    EXPECT_EQ(q, p);
    dev.fill(second, q, 0x22, mib);
    dev.synchronize(first);
    EXPECT_TRUE(all_equal(this->read(q, mib, second), 0x22)) << "`second` wrote before `first` was done";
    a.deallocate(q, second);
  }
  a.destroy_private_pool(pool);
  dev.free_segment(region);
}

// A clear or destroy that refuses live blocks forgets which streams last used
// the free memory: each waits for them first. (A clear handed the memory to
// another stream with no wait, so a write still queued on the first landed
// in the new block; a destroy gave a region back to its owner under it.)
TYPED_TEST(allocator_memory, a_clear_or_destroy_refusing_live_blocks_waits_for_the_streams_that_last_used_the_memory) {
  using namespace std::chrono_literals;
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream first(dev), second(dev);
  void* region = dev.allocate_segment(2 * mib);
  const auto pool = a.create_private_pool(region, 2 * mib);
  const auto freed_while_written = [&] {
    alloc::private_pool_scope scope(a, pool);
    void* p = a.allocate(mib, first);
    dev.delay(first, 200ms);
    dev.fill(first, p, 0x11, mib);  // the first stream's last use, still queued
    a.deallocate(p, first);
    return p;
  };
  void* p = freed_while_written();
  a.clear_private_pool(pool);
  {
    alloc::private_pool_scope scope(a, pool);
    void* q = a.allocate(mib, second);
    EXPECT_EQ(q, p);
    dev.fill(second, q, 0x22, mib);
    dev.synchronize(first);
    EXPECT_TRUE(all_equal(this->read(q, mib, second), 0x22)) << "the clear forgot a stream still writing the memory";
    a.deallocate(q, second);
  }
  (void)freed_while_written();
  a.destroy_private_pool(pool);
  EXPECT_TRUE(dev.query(first)) << "the region went back to its owner while a stream still wrote it";
  dev.synchronize(first);
  dev.free_segment(region);
}

// A request past the device's memory is out of memory before a growable
// range is reserved for it: a range of its size (and host memory for each
// chunk of it) was kept for the pool's life.
TEST(allocator_memory_host, a_request_past_the_device_reserves_no_growable_range_for_itself) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:true"));
  EXPECT_THROW((void)a.allocate(std::size_t{1} << 40, {}), out_of_memory);
  EXPECT_TRUE(a.take_snapshot().segments.empty()) << "a range of the request's size stayed reserved";
  void* p = a.allocate(mib, {});
  const auto snap = a.take_snapshot();
  ASSERT_EQ(snap.segments.size(), 1U);
  EXPECT_EQ(snap.segments[0].size, 64 * mib) << "the pool's one range is as large as the device";
  a.deallocate(p, {});
}

TEST(allocator_memory_host, out_of_device_memory_is_out_of_memory) {
  backend::host_device dev({.capacity_bytes = 32 * mib});
  alloc::caching_allocator a(dev, {});
  void* p = a.allocate(20 * mib, {});
  EXPECT_THROW((void)a.allocate(20 * mib, {}), out_of_memory);
  a.deallocate(p, {});
  void* q = a.allocate(20 * mib, {});
  a.deallocate(q, {});
}

TEST(allocator_memory_host, destroying_the_allocator_returns_even_leaked_blocks) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  {
    alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:false"));
    (void)a.allocate(30 * mib, {});  // never freed
    (void)a.allocate(4096, {});
    EXPECT_LT(dev.memory().free_bytes, 64 * mib);
  }
  EXPECT_EQ(dev.memory().free_bytes, 64 * mib);
  {
    alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:true"));
    (void)a.allocate(30 * mib, {});
  }
  EXPECT_EQ(dev.memory().free_bytes, 64 * mib);
}

TEST(allocator_memory_host, growth_that_fails_half_way_takes_back_what_it_mapped) {
  // 40 MiB of device: growing by 34 MiB after 10 maps a 24 MiB chunk, then
  // the device refuses the second (chunks are at most 24 MiB).
  backend::host_device dev({.capacity_bytes = 40 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:true"));
  void* first = a.allocate(10 * mib, {});
  EXPECT_THROW((void)a.allocate(34 * mib, {}), out_of_memory);
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(10 * mib));
  EXPECT_EQ(dev.memory().free_bytes, 30 * mib) << "the chunks of the failed growth were released";
  a.deallocate(first, {});
  void* bigger = a.allocate(38 * mib, {});  // the allocator is still whole
  a.deallocate(bigger, {});
}

TEST(allocator_memory_host, a_growth_maps_chunks_of_128_mib_until_memory_went_back_then_of_24) {
  // While a growable segment has given nothing back, no chunk's size decides
  // what can go back, so a growth maps as few chunks as it can (each costs
  // an access grant); once memory went back, growths are cut finer so that
  // free memory can go back again.
  backend::host_device dev({.capacity_bytes = 1024 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:true"));
  void* kept = a.allocate(10 * mib, {});  // holds the segment through the empty_cache below
  EXPECT_EQ(a.stats().device_allocations, 1);
  void* p = a.allocate(300 * mib, {});
  EXPECT_EQ(a.stats().device_allocations, 4) << "128 + 128 + 44 MiB: one device call each";
  a.deallocate(p, {});
  a.empty_cache();
  EXPECT_EQ(a.stats().device_frees, 3);
  void* q = a.allocate(60 * mib, {});
  EXPECT_EQ(a.stats().device_allocations, 7) << "24 + 24 + 12 MiB once the segment gave memory back";
  a.deallocate(q, {});
  a.deallocate(kept, {});
  a.empty_cache();
  EXPECT_EQ(a.stats().device_frees, 7);
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
}

TEST(allocator_memory_host, a_growable_block_s_rest_is_split_off_however_small) {
  // Kept with its block, the rest of the last chunk would be held beside it;
  // split off, the next growth joins it.
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:true"));
  void* p = a.allocate(3 * mib + kib, {});
  EXPECT_EQ(a.block_size(p), 3 * mib + kib);
  void* q = a.allocate(2 * mib, {});
  EXPECT_EQ(static_cast<char*>(q), static_cast<char*>(p) + 3 * mib + kib) << "placed in the rest, joined to the growth";
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(6 * mib));
  a.deallocate(p, {});
  a.deallocate(q, {});
}

TEST(allocator_memory_host, an_oversize_request_grown_onto_a_free_neighbour_gets_only_its_size) {
  // Growth joins the free 34 MiB block before the unbacked tail and maps
  // 2 MiB more; the merged 36 MiB must not all go to a 35 MiB request
  // because 35 MiB is past max_split_size.
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:true,max_split_size_mb:32"));
  void* x = a.allocate(4 * mib, {});
  a.deallocate(a.allocate(34 * mib, {}), {});
  void* z = a.allocate(35 * mib, {});
  EXPECT_EQ(a.block_size(z), 35 * mib);
  a.check_invariants();
  for (void* p : {x, z}) a.deallocate(p, {});
}

// With expandable segments a free block of max_split_size or more is split
// for smaller requests: kept whole, each would map more memory beside it.
TEST(allocator_memory_host, with_expandable_segments_a_free_oversize_block_serves_smaller_requests) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:true,max_split_size_mb:64"));
  a.deallocate(a.allocate(100 * mib, {}), {});
  std::vector<void*> held;
  for (int i = 0; i < 10; ++i) held.push_back(a.allocate(4 * mib, {}));
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(100 * mib))
      << "the requests were not carved from the free 100 MiB";
  a.check_invariants();
  for (void* p : held) a.deallocate(p, {});
}

TEST(allocator_memory_host, growth_past_the_peak_unmaps_free_chunks_first) {
  for (const bool release : {true, false}) {
    backend::host_device dev({.capacity_bytes = 256 * mib});
    alloc::caching_allocator a(dev, alloc::allocator_config::parse(
                                        std::string("expandable_segments:true,release_idle_before_grow:") +
                                        (release ? "true" : "false")));
    void* x = a.allocate(10 * mib, {});
    void* hole = a.allocate(10 * mib, {});
    void* y = a.allocate(10 * mib, {});
    a.deallocate(hole, {});
    void* bigger = a.allocate(12 * mib, {});  // not in the hole: mapped after y
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>((release ? 32 : 42) * mib))
        << "release_idle_before_grow " << release;
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.peak, static_cast<std::int64_t>((release ? 32 : 42) * mib));
    for (void* p : {x, y, bigger}) a.deallocate(p, {});
  }
}

TEST(allocator_memory_host, growth_below_the_peak_keeps_idle_segments_for_reuse) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, {});
  void* kept = a.allocate(50 * mib, {});
  a.deallocate(a.allocate(50 * mib, {}), {});
  a.empty_cache();  // reserved 50 MiB, peak 100
  a.deallocate(a.allocate(12 * mib, {}), {});  // an idle 12 MiB segment
  const auto frees = a.stats().device_frees;
  void* larger = a.allocate(14 * mib, {});  // does not fit in it; 76 MiB stays below the peak
  EXPECT_EQ(a.stats().device_frees, frees) << "the idle segment is kept: giving it back would lower no peak";
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(76 * mib));
  const auto allocations = a.stats().device_allocations;
  void* again = a.allocate(12 * mib, {});
  EXPECT_EQ(a.stats().device_allocations, allocations) << "and reused without a device call";
  for (void* p : {kept, larger, again}) a.deallocate(p, {});
}

TEST(allocator_memory_host, growth_past_the_peak_takes_the_other_size_class_s_idle_memory) {
  for (const bool expandable : {false, true}) {
    backend::host_device dev({.capacity_bytes = 256 * mib});
    alloc::caching_allocator a(dev, alloc::allocator_config::parse(std::string("expandable_segments:") +
                                                                   (expandable ? "true" : "false")));
    a.deallocate(a.allocate(mib, {}), {});  // the small pool holds an idle 2 MiB
    void* large = a.allocate(20 * mib, {});
    const auto st = a.stats();
    EXPECT_EQ(st.reserved_bytes.pool[static_cast<std::size_t>(alloc::pool_kind::small)].current, 0)
        << "expandable " << expandable;
    EXPECT_EQ(st.reserved_bytes.aggregate.peak, static_cast<std::int64_t>(20 * mib)) << "expandable " << expandable;
    a.deallocate(large, {});
  }
}

TEST(allocator_memory_host, the_reserved_peak_is_the_total_s_not_a_sum_of_pool_peaks) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("release_idle_before_grow:false"));
  a.deallocate(a.allocate(mib, {}), {});  // the small pool peaks at 2 MiB
  a.empty_cache();
  void* large = a.allocate(20 * mib, {});  // the large pool at 20, later
  const auto st = a.stats();
  EXPECT_EQ(st.reserved_bytes.pool[static_cast<std::size_t>(alloc::pool_kind::small)].peak,
            static_cast<std::int64_t>(2 * mib));
  EXPECT_EQ(st.reserved_bytes.aggregate.peak, static_cast<std::int64_t>(20 * mib));
  a.deallocate(large, {});
  a.reset_peak_stats();
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.peak, static_cast<std::int64_t>(20 * mib)) << "still cached";
}

TEST(allocator_memory_host, running_out_does_not_wait_for_streams_with_nothing_to_give_back) {
  using namespace std::chrono_literals;
  backend::host_device dev({.capacity_bytes = 32 * mib});
  alloc::caching_allocator a(dev, {});
  backend::stream busy(dev), mine(dev);
  void* held = a.allocate(20 * mib, busy);  // busy's pool: in use, nothing cached
  dev.delay(busy, 2000ms);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)a.allocate(20 * mib, mine), out_of_memory);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1000ms) << "waited for a stream that had nothing to give back";
  dev.synchronize(busy);
  a.deallocate(held, busy);
}

TEST(allocator_memory_host, memory_fraction_limits_reserved_bytes) {
  backend::host_device dev({.capacity_bytes = 100 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("memory_fraction:0.25"));
  void* p = a.allocate(20 * mib, {});
  EXPECT_THROW((void)a.allocate(20 * mib, {}), out_of_memory) << "25 MiB of 100";
  a.deallocate(p, {});
}

TEST(allocator_memory_host, set_memory_fraction_moves_the_limit_at_run_time) {
  backend::host_device dev({.capacity_bytes = 100 * mib});
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("memory_fraction:0.5,debug:true"));
  EXPECT_EQ(a.memory_limit(), 50 * mib);
  void* p = a.allocate(20 * mib, {});
  a.set_memory_fraction(0.25);
  EXPECT_EQ(a.memory_limit(), 25 * mib);
  EXPECT_THROW((void)a.allocate(20 * mib, {}), out_of_memory) << "the lowered limit holds";
  a.set_memory_fraction(0.1);  // below what is reserved: that memory stays, nothing more is taken
  EXPECT_THROW((void)a.allocate(2 * mib, {}), out_of_memory);
  a.check_invariants();
  a.deallocate(p, {});
  a.empty_cache();
  void* small = a.allocate(2 * mib, {});  // under the limit again
  a.set_memory_fraction(0);  // no share limit
  EXPECT_EQ(a.memory_limit(), alloc::allocator_config::no_limit);
  void* big = a.allocate(60 * mib, {});
  a.check_invariants();
  a.deallocate(big, {});
  a.deallocate(small, {});
  EXPECT_THROW(a.set_memory_fraction(1.5), invalid_argument);
  EXPECT_THROW(a.set_memory_fraction(-0.1), invalid_argument);
}

// Every refusal below is the limit's alone: the device has room for it.
TEST(allocator_memory_host, an_out_of_memory_report_gives_the_memory_fraction_s_share_of_the_device_as_its_limit) {
  backend::host_device dev({.capacity_bytes = 100 * mib});
  const std::size_t total = dev.memory().total_bytes;
  ASSERT_EQ(total, 100 * mib);
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("memory_fraction:0.25,memory_limit_mb:80"));
  std::vector<alloc::oom_report> reports;
  a.add_oom_observer([&](const alloc::oom_report& r) { reports.push_back(r); });
  void* held = a.allocate(20 * mib, {});
  EXPECT_THROW((void)a.allocate(20 * mib, {}), out_of_memory);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].limit_bytes, total / 4) << "the configured fraction's share, below memory_limit_mb";

  a.set_memory_fraction(0.5);
  EXPECT_THROW((void)a.allocate(40 * mib, {}), out_of_memory);
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[1].limit_bytes, total / 2) << "the share set at run time";

  a.set_memory_fraction(0.9);
  EXPECT_THROW((void)a.allocate(70 * mib, {}), out_of_memory);
  ASSERT_EQ(reports.size(), 3u);
  EXPECT_EQ(reports[2].limit_bytes, 80 * mib) << "memory_limit_mb, now below the share";
  EXPECT_EQ(a.stats().ooms, 3);
  a.deallocate(held, {});
}

TEST(allocator_memory_host, cache_miss_hooks_run_before_the_device_is_asked_and_may_free) {
  backend::host_device dev({.capacity_bytes = 64 * mib});
  alloc::caching_allocator a(dev, {});
  void* kept = a.allocate(20 * mib, {});  // fills its segment: the next request misses
  int calls = 0;
  const auto id = a.add_cache_miss_hook([&] {
    ++calls;
    if (kept != nullptr) a.deallocate(std::exchange(kept, nullptr), {});  // frees, as limbo collection does
  });
  const auto segments = a.stats().segments.aggregate.current;
  void* p = a.allocate(20 * mib, {});
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(a.stats().segments.aggregate.current, segments) << "served by the block the hook freed";
  a.deallocate(p, {});
  void* q = a.allocate(20 * mib, {});  // the cache serves this one: no miss
  EXPECT_EQ(calls, 1);
  a.remove_hook(id);
  EXPECT_THROW(a.remove_hook(id), invalid_argument);
  void* r = a.allocate(40 * mib, {});
  EXPECT_EQ(calls, 1) << "a removed hook is not called";
  for (void* x : {q, r}) a.deallocate(x, {});
}

TEST(allocator_memory_host, release_observers_see_every_range_given_back) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  for (const char* conf : {"", "expandable_segments:true"}) {
    alloc::caching_allocator a(dev, alloc::allocator_config::parse(conf));
    std::vector<std::pair<std::uintptr_t, std::size_t>> released;
    const auto id = a.add_release_observer([&](std::uintptr_t base, std::size_t bytes) { released.emplace_back(base, bytes); });
    void* p = a.allocate(30 * mib, {});
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    a.deallocate(p, {});
    EXPECT_TRUE(released.empty()) << conf << ": a free keeps the memory cached";
    a.empty_cache();
    std::size_t covered = 0;
    for (auto [base, bytes] : released) {
      if (base <= at && at < base + bytes) covered = bytes;
    }
    EXPECT_GE(covered, 30 * mib) << conf << ": the block's range was reported given back";
    a.remove_hook(id);
  }
}

TEST(allocator_memory_host, a_release_observer_runs_while_the_range_is_still_mapped) {
  backend::host_device dev({.capacity_bytes = 256 * mib});
  for (const char* conf : {"", "expandable_segments:true"}) {
    alloc::caching_allocator a(dev, alloc::allocator_config::parse(conf));
    std::size_t readable = 0, seen = 0;
    const auto id = a.add_release_observer([&](std::uintptr_t base, std::size_t bytes) {
      ++seen;
      // Reading the range faults if it was given back already.
      if (*reinterpret_cast<volatile const std::uint8_t*>(base + bytes - 1) == 0x5A) ++readable;
    });
    void* p = a.allocate(30 * mib, {});
    dev.fill({}, p, 0x5A, 30 * mib);
    dev.synchronize({});
    a.deallocate(p, {});
    a.empty_cache();
    EXPECT_GT(seen, 0u) << conf;
    EXPECT_EQ(readable, seen) << conf << ": every range the observer was told of was still there";
    a.remove_hook(id);
  }
}

// A release and a growth on two streams at once: the released segment's
// address may be the very one the device hands the other stream next. The
// observer sleeps inside the release, so the growth surely falls within it.
TEST(allocator_memory_host, a_segment_released_while_another_stream_grows_loses_no_live_block) {
  auto& dev = backend::host_device_instance();
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(""));
  backend::stream releasing(dev), growing(dev);
  std::atomic<bool> in_release{false};
  const auto id = a.add_release_observer([&](std::uintptr_t, std::size_t) {
    in_release = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  for (int round = 0; round < 3; ++round) {
    in_release = false;
    void* cached = a.allocate(mib, releasing);  // a 2 MiB small-pool segment on `releasing`
    const auto released_base = reinterpret_cast<std::uintptr_t>(cached);
    a.deallocate(cached, releasing);
    std::thread releaser([&] { a.empty_cache(); });
    while (!in_release) std::this_thread::yield();
    void* live = a.allocate(mib, growing);  // a new segment for `growing`, during the release
    releaser.join();
    EXPECT_NE(reinterpret_cast<std::uintptr_t>(live), released_base)
        << "round " << round << ": the device gave the released segment out again before its release finished";
    EXPECT_NO_THROW(EXPECT_EQ(a.block_size(live), mib)) << "round " << round << ": the live block was lost";
    EXPECT_NO_THROW(a.record_stream(live, releasing)) << "round " << round;
    EXPECT_NO_THROW(a.deallocate(live, growing)) << "round " << round;
    dev.synchronize(releasing);
    a.process_pending_frees();
    a.empty_cache();
  }
  a.remove_hook(id);
  a.check_invariants();
}

}  // namespace
}  // namespace shoal::testing
