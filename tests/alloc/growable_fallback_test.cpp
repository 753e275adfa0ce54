// expandable_segments on a device without growable ranges (a CUDA device or
// driver without virtual memory management): plain segments serve instead,
// and the allocator says so in config() and stats().
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "support/growable_support_device.h"

namespace shoal::testing {
namespace {

constexpr std::size_t kib = 1024, mib = kib * kib;
constexpr backend::growable_support none{.supported = false, .shareable = false};
constexpr backend::growable_support full{.supported = true, .shareable = true};

alloc::allocator_config expandable() { return alloc::allocator_config::parse("expandable_segments:true"); }

TEST(growable_fallback, expandable_segments_without_growable_ranges_allocate_from_plain_segments) {
  backend::host_device host({.capacity_bytes = 256 * mib});
  growable_support_device dev(host, none);
  alloc::caching_allocator a(dev, expandable());
  void* small = a.allocate(64 * kib, {});
  void* large = a.allocate(30 * mib, {});
  std::memset(small, 0x5A, 64 * kib);
  std::memset(large, 0xA5, 30 * mib);
  a.deallocate(small, {});
  a.deallocate(large, {});
  a.check_invariants();

  EXPECT_EQ(dev.growable_calls, 0) << "no growable range was tried";
  EXPECT_EQ(dev.plain_allocations, 2) << "a small-pool and a large-pool segment";
  EXPECT_EQ(a.stats().device_allocations, dev.plain_allocations);
  for (const auto& s : a.take_snapshot().segments) {
    EXPECT_FALSE(s.expandable);
    EXPECT_EQ(s.mapped_bytes, s.size);
  }
  a.empty_cache();
  EXPECT_EQ(dev.plain_frees, 2);
  EXPECT_EQ(a.stats().device_frees, 2);
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
}

TEST(growable_fallback, the_fallback_shows_in_config_stats_and_their_json) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  growable_support_device dev(host, none);
  alloc::caching_allocator a(dev, expandable());
  EXPECT_FALSE(a.config().expandable_segments) << "config() is the setting in force";
  EXPECT_NE(a.config().to_string().find("expandable_segments:false"), std::string::npos);
  EXPECT_TRUE(a.stats().expandable_segments_fallback);
  EXPECT_NE(a.stats().to_json().find("\"expandable_segments_fallback\":true"), std::string::npos);
  a.reset_accumulated_stats();
  a.reset_peak_stats();
  EXPECT_TRUE(a.stats().expandable_segments_fallback) << "a fact about the allocator, not a counter";
}

TEST(growable_fallback, a_device_with_growable_ranges_gets_growable_segments_and_no_fallback) {
  for (const backend::growable_support support : {full, backend::growable_support{.supported = true}}) {
    backend::host_device host({.capacity_bytes = 256 * mib});
    growable_support_device dev(host, support);
    alloc::caching_allocator a(dev, expandable());
    void* p = a.allocate(30 * mib, {});
    std::memset(p, 0x3C, 30 * mib);
    a.deallocate(p, {});
    a.check_invariants();
    EXPECT_GT(dev.growable_calls, 0) << "shareable " << support.shareable;
    EXPECT_EQ(dev.plain_allocations, 0) << "shareable " << support.shareable;
    const auto snap = a.take_snapshot();
    ASSERT_EQ(snap.segments.size(), 1u);
    EXPECT_TRUE(snap.segments[0].expandable);
    EXPECT_TRUE(a.config().expandable_segments);
    EXPECT_FALSE(a.stats().expandable_segments_fallback);
    EXPECT_NE(a.stats().to_json().find("\"expandable_segments_fallback\":false"), std::string::npos);
  }
}

TEST(growable_fallback, plain_segments_asked_for_are_no_fallback) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  growable_support_device dev(host, none);
  alloc::caching_allocator a(dev, alloc::allocator_config::parse("expandable_segments:false"));
  a.deallocate(a.allocate(kib, {}), {});
  EXPECT_FALSE(a.stats().expandable_segments_fallback);
  EXPECT_EQ(dev.growable_calls, 0);
}

TEST(growable_fallback, pinned_host_memory_with_expandable_segments_is_still_refused) {
  backend::host_device host({.capacity_bytes = 64 * mib});
  growable_support_device dev(host, none);
  EXPECT_THROW(alloc::caching_allocator(dev, alloc::allocator_config::parse("memory:pinned_host,expandable_segments:true")),
               invalid_argument)
      << "a setting that never applies is an error, not a fallback";
}

}  // namespace
}  // namespace shoal::testing
