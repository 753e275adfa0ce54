// SHOAL_ALLOC_CONF parsing.
#include <gtest/gtest.h>

#include <cstdlib>

#include "shoal/alloc/config.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using alloc::allocator_config;
constexpr std::size_t mib = std::size_t{1} << 20;

TEST(allocator_config, defaults) {
  const allocator_config c;
  EXPECT_EQ(c.max_split_size, allocator_config::no_limit);
  EXPECT_EQ(c.max_non_split_rounding, 20 * mib);
  EXPECT_TRUE(c.cross_stream_safety);
  EXPECT_TRUE(c.release_idle_before_grow);
  EXPECT_FALSE(c.expandable_segments);
  EXPECT_FALSE(c.debug);
}

TEST(allocator_config, parses_every_key) {
  const auto c = allocator_config::parse(
      " max_split_size_mb:256, max_non_split_rounding_mb:4,expandable_segments:true,debug:True,"
      "cross_stream_safety:false,memory_limit_mb:1024,memory_fraction:0.5,trace_entries:100,"
      "release_idle_before_grow:false");
  EXPECT_EQ(c.max_split_size, 256 * mib);
  EXPECT_EQ(c.max_non_split_rounding, 4 * mib);
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_TRUE(c.debug);
  EXPECT_FALSE(c.cross_stream_safety);
  EXPECT_FALSE(c.release_idle_before_grow);
  EXPECT_EQ(c.memory_limit, 1024 * mib);
  EXPECT_DOUBLE_EQ(c.memory_fraction, 0.5);
  EXPECT_EQ(c.trace_entries, 100u);
}

TEST(allocator_config, roundup_divisions_as_one_number_or_a_list) {
  auto c = allocator_config::parse("roundup_power2_divisions:4");
  EXPECT_EQ(c.roundup_power2_divisions[10], 4u);
  EXPECT_EQ(c.roundup_power2_divisions[40], 4u);
  c = allocator_config::parse("roundup_power2_divisions:[1:2,64:8,>:1]");
  EXPECT_EQ(c.roundup_power2_divisions[12], 2u) << "the interval above 4 KiB starts below 1 MiB";
  EXPECT_EQ(c.roundup_power2_divisions[19], 2u);
  EXPECT_EQ(c.roundup_power2_divisions[20], 8u) << "the interval above 1 MiB takes the second entry";
  EXPECT_EQ(c.roundup_power2_divisions[25], 8u);
  EXPECT_EQ(c.roundup_power2_divisions[26], 1u) << "the interval above 64 MiB takes the last";
}

TEST(allocator_config, text_round_trips) {
  for (const char* divisions : {"[2:4,>:2]", "[1:4,>:8]", "[1:1,>:8]", "[1:2,4:4,>:1]", "8"}) {
    SCOPED_TRACE(divisions);
    const auto c = allocator_config::parse(std::string("max_split_size_mb:64,debug:true,roundup_power2_divisions:") +
                                           divisions);
    const auto back = allocator_config::parse(c.to_string());
    EXPECT_EQ(back.max_split_size, c.max_split_size);
    EXPECT_EQ(back.roundup_power2_divisions, c.roundup_power2_divisions) << c.to_string();
    EXPECT_EQ(back.debug, c.debug);
  }
}

TEST(allocator_config, unknown_keys_and_bad_values_are_named) {
  auto refused = [](const char* text, const char* must_mention) {
    try {
      (void)allocator_config::parse(text);
      ADD_FAILURE() << text << " was accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(must_mention), std::string::npos) << e.what();
    }
  };
  refused("max_split_size:10", "unknown key 'max_split_size'");
  refused("max_split_size_mb:abc", "max_split_size_mb:abc");
  refused("max_split_size_mb:0", "max_split_size_mb");
  refused("expandable_segments:yes", "true or false");
  refused("memory_fraction:1.5", "memory_fraction");
  refused("roundup_power2_divisions:3", "power of two");
  refused("roundup_power2_divisions:[64:4,1:2]", "increasing");
  refused("debug", "no ':'");
}

TEST(allocator_config, read_from_the_environment) {
  ::setenv("SHOAL_ALLOC_CONF", "debug:true,trace_entries:7", 1);
  const auto c = allocator_config::from_environment();
  ::unsetenv("SHOAL_ALLOC_CONF");
  EXPECT_TRUE(c.debug);
  EXPECT_EQ(c.trace_entries, 7u);
  EXPECT_FALSE(allocator_config::from_environment().debug);
}

}  // namespace
}  // namespace shoal::testing
