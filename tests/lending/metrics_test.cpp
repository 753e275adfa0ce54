// The metrics text stays under the frame limit however many regions there
// are: the totals always, per-region, per-hold and per-spare samples while
// they fit, and what was left out counted and marked.
#include <gtest/gtest.h>

#include <string>

#include "lending/messages.h"
#include "lending/metrics.h"

namespace shoal::testing {
namespace {

using lending::detail::max_metrics_text;
using lending::detail::prometheus_text;

/// A status of `regions` shared regions with long names, each with two
/// holds, and as many spare chunks.
lending::lender_status crowded(std::size_t regions) {
  lending::lender_status s;
  s.capacity_bytes = std::size_t{1} << 40;
  for (std::size_t i = 1; i <= regions; ++i) {
    lending::region_info r;
    r.id = i;
    r.memory = i;
    r.bytes = 4096;
    r.purpose = "a model with a long name, number " + std::to_string(i) + std::string(24, 'x');
    r.mode = lending::region_mode::shared;
    r.holders = {{process_identity::self(), 0, lending::region_state::lent},
                 {{static_cast<pid_t>(i), 1}, 0, lending::region_state::orphaned}};
    s.regions.push_back(r);
    s.spares.push_back({i + regions, 4096, 0, 1, {}});
    s.lent_bytes += r.bytes;
  }
  return s;
}

std::uint64_t left_out(const std::string& text, const std::string& series) {
  const std::string key = "shoal_lending_samples_left_out{series=\"" + series + "\"} ";
  const auto at = text.find(key);
  EXPECT_NE(at, std::string::npos) << "no " << key;
  return at == std::string::npos ? 0 : std::stoull(text.substr(at + key.size()));
}

std::size_t count_of(const std::string& text, const std::string& prefix) {
  std::size_t count = 0;
  for (auto at = text.find("\n" + prefix); at != std::string::npos; at = text.find("\n" + prefix, at + 1)) ++count;
  return count;
}

TEST(lending_metrics, many_regions_stay_under_the_frame_limit_with_what_was_left_out_counted) {
  const auto s = crowded(20000);
  const std::string text = prometheus_text(s, max_metrics_text);
  EXPECT_LE(text.size(), max_metrics_text);
  EXPECT_NE(text.find("\n# truncated: "), std::string::npos);
  EXPECT_NE(text.find("\nshoal_lending_regions 20000\n"), std::string::npos) << "the totals count every region";
  const std::size_t regions = count_of(text, "shoal_lending_region_bytes{");
  const std::size_t holds = count_of(text, "shoal_lending_region_holds{");
  const std::size_t spares = count_of(text, "shoal_lending_spare_chunk_bytes{");
  EXPECT_GT(regions, 1000u) << "samples kept while they fit";
  EXPECT_EQ(regions + left_out(text, "region_bytes"), 20000u);
  EXPECT_EQ(holds + left_out(text, "region_holds"), 40000u);
  EXPECT_EQ(spares + left_out(text, "spare_chunk_bytes"), 20000u);
}

TEST(lending_metrics, a_smaller_limit_keeps_fewer_samples_and_still_holds) {
  const auto s = crowded(500);
  const std::string text = prometheus_text(s, 64 * 1024);
  EXPECT_LE(text.size(), 64u * 1024);
  EXPECT_EQ(count_of(text, "shoal_lending_region_bytes{") + left_out(text, "region_bytes"), 500u);
  EXPECT_GT(left_out(text, "spare_chunk_bytes"), 0u);
}

TEST(lending_metrics, a_text_that_fits_is_whole_and_says_nothing_was_left_out) {
  const auto s = crowded(10);
  const std::string text = prometheus_text(s, max_metrics_text);
  EXPECT_EQ(text.find("# truncated"), std::string::npos);
  EXPECT_EQ(count_of(text, "shoal_lending_region_bytes{"), 10u);
  EXPECT_EQ(count_of(text, "shoal_lending_region_holds{"), 20u);
  EXPECT_EQ(count_of(text, "shoal_lending_spare_chunk_bytes{"), 10u);
  EXPECT_EQ(left_out(text, "region_bytes") + left_out(text, "region_holds") + left_out(text, "spare_chunk_bytes"), 0u);
}

}  // namespace
}  // namespace shoal::testing
