// The daemon log's rate limit per borrower (tools/shoal/daemon_log.h), on a
// clock the tests move: the bound on the borrowers it tracks (the one seen
// longest ago evicted, its count said first), entries that say nothing
// dropped by tick, events of no borrower sharing one bucket, JSON summaries,
// and — over a deterministic random schedule — every record made either
// written or counted in exactly one summary. The log's lines are read back
// from standard error (gtest's capture), once the log has drained.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tools/shoal/daemon_log.h"

namespace shoal::testing {
namespace {

using tools::daemon_log;
using tools::log_rate_limit;
using kind = lending::lender_event::kind;
using clock_type = log_rate_limit::clock;
using namespace std::chrono_literals;

lending::lender_event event_of(pid_t pid, kind what) {
  lending::lender_event e;
  e.what = what;
  e.borrower = {pid, pid == 0 ? 0 : 1000 + static_cast<std::uint64_t>(pid)};
  e.uid = 1000;
  return e;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The lines that match `pattern` (a regex searched in each line).
std::vector<std::string> matching(const std::vector<std::string>& lines, const std::string& pattern) {
  std::vector<std::string> found;
  const std::regex re(pattern);
  for (const auto& line : lines) {
    if (std::regex_search(line, re)) found.push_back(line);
  }
  return found;
}

// Runs `body` with a text (or JSON) log and a limit of `rate` records a
// second, and returns the lines the log wrote.
template <class Body>
std::vector<std::string> logged(std::uint64_t rate, bool json, Body&& body) {
  ::testing::internal::CaptureStderr();
  {
    daemon_log log(json);
    log_rate_limit limit(log, rate);
    body(limit);
  }  // the log drains before it goes
  return lines_of(::testing::internal::GetCapturedStderr());
}

TEST(daemon_log_rate, a_crowd_past_the_table_evicts_the_borrower_seen_longest_ago_saying_its_count_first) {
  const auto t0 = clock_type::now();
  std::size_t tracked_at_the_bound = 0;
  std::size_t tracked_after = 0;
  const auto lines = logged(1, false, [&](log_rate_limit& limit) {
    // pid 1: its burst of 10 written, the 11th left out; seen first.
    for (int i = 0; i < 11; ++i) limit.record(event_of(1, kind::lent), t0);
    // A crowd, each with a bucket not yet full again: nothing tick may drop.
    for (pid_t pid = 2; pid <= static_cast<pid_t>(log_rate_limit::max_tracked); ++pid) {
      limit.record(event_of(pid, kind::connected), t0 + std::chrono::microseconds(pid));
    }
    tracked_at_the_bound = limit.tracked();
    limit.record(event_of(100000, kind::connected), t0 + 10ms);
    tracked_after = limit.tracked();
    limit.record(event_of(1, kind::lent), t0 + 11ms);  // back, afresh: written
  });
  EXPECT_EQ(tracked_at_the_bound, log_rate_limit::max_tracked);
  EXPECT_EQ(tracked_after, log_rate_limit::max_tracked) << "the table grew past its bound";
  const auto evicted = matching(lines, "event=log_records_suppressed pid=1 uid=1000 records=1 reason=evicted lent=1$");
  EXPECT_EQ(evicted.size(), 1U) << "the evicted borrower's count was not said";
  EXPECT_TRUE(matching(lines, "reason=evicted").size() == 1) << "another borrower than the one seen longest ago went";
  EXPECT_EQ(matching(lines, "event=lent pid=1 ").size(), 11U) << "pid 1 did not start afresh after its eviction";
}

TEST(daemon_log_rate, tick_drops_the_entries_that_say_nothing_and_summarizes_the_quiet_ones) {
  const auto t0 = clock_type::now();
  std::size_t after_first_tick = 0;
  std::size_t after_second_tick = 0;
  const auto lines = logged(1, false, [&](log_rate_limit& limit) {
    for (pid_t pid = 1; pid <= 3; ++pid) limit.record(event_of(pid, kind::connected), t0);
    for (int i = 0; i < 12; ++i) limit.record(event_of(4, kind::given_back), t0);  // 2 left out
    limit.tick(t0 + 2s);  // the three refilled: dropped; pid 4's summary not due yet
    after_first_tick = limit.tracked();
    limit.tick(t0 + 12s);  // pid 4's summary due, its bucket full again: then it too says nothing
    after_second_tick = limit.tracked();
  });
  EXPECT_EQ(after_first_tick, 1U) << "full buckets with nothing pending were kept";
  EXPECT_EQ(after_second_tick, 0U);
  EXPECT_EQ(matching(lines, "event=log_records_suppressed pid=4 uid=1000 records=2 reason=interval given_back=2$").size(),
            1U);
}

TEST(daemon_log_rate, events_of_no_borrower_share_one_bucket_said_as_pid_0) {
  const auto t0 = clock_type::now();
  std::uint64_t suppressed = 0;
  const auto lines = logged(1, false, [&](log_rate_limit& limit) {
    for (int i = 0; i < 8; ++i) limit.record(event_of(0, kind::refused), t0);
    for (int i = 0; i < 7; ++i) limit.record(event_of(0, kind::spare_released), t0);
    suppressed = limit.suppressed();
    limit.flush();
  });
  EXPECT_EQ(suppressed, 5U);
  EXPECT_EQ(matching(lines, "event=(refused|spare_released) pid=0 ").size(), 10U);
  EXPECT_EQ(
      matching(lines, "event=log_records_suppressed pid=0 uid=1000 records=5 reason=stopping spare_released=5$").size(),
      1U);
}

TEST(daemon_log_rate, a_json_summary_carries_its_counts_as_numbers) {
  const auto t0 = clock_type::now();
  const auto lines = logged(1, true, [&](log_rate_limit& limit) {
    for (int i = 0; i < 12; ++i) limit.record(event_of(7, kind::refused), t0);
    limit.record(event_of(7, kind::disconnected), t0);  // past the limit too: counted, then the summary
  });
  const auto summaries = matching(lines, "\"event\":\"log_records_suppressed\"");
  ASSERT_EQ(summaries.size(), 1U);
  EXPECT_NE(summaries[0].find(R"("pid":7,"uid":1000,"records":3,"reason":"disconnected","disconnected":1,"refused":2})"),
            std::string::npos)
      << summaries[0];
}

// A deterministic random schedule of borrowers (and pid 0), routine events,
// warnings, disconnections, ticks and time: the records written and those
// counted in summaries add up to the records made, and no borrower's count
// is said twice.
TEST(daemon_log_rate, every_record_made_is_written_or_counted_once_over_a_random_schedule) {
  for (const unsigned seed : {1U, 2U, 3U}) {
    std::mt19937 random(seed);
    std::uint64_t made = 0;
    const auto lines = logged(2, false, [&](log_rate_limit& limit) {
      auto now = clock_type::now();
      const kind routine[] = {kind::connected, kind::lent, kind::given_back, kind::refused, kind::waiting};
      for (int step = 0; step < 3000; ++step) {
        now += std::chrono::milliseconds(random() % 20);
        const auto pid = static_cast<pid_t>(random() % 13);
        const unsigned dice = random() % 100;
        if (dice < 3) {
          limit.tick(now);
          continue;
        }
        const kind what = dice < 5 ? kind::closed_for_error : dice < 8 ? kind::disconnected : routine[random() % 5];
        limit.record(event_of(pid, what), now);
        ++made;
      }
      limit.flush();
    });
    std::uint64_t written = 0;
    std::uint64_t counted = 0;
    const std::regex summary("event=log_records_suppressed .*records=([0-9]+) ");
    for (const auto& line : lines) {
      std::smatch m;
      if (std::regex_search(line, m, summary)) {
        counted += std::stoull(m[1]);
      } else if (line.find(" event=") != std::string::npos) {
        ++written;
      }
    }
    EXPECT_EQ(written + counted, made) << "seed " << seed << ": " << written << " written, " << counted << " counted";
    EXPECT_GT(counted, 0U) << "seed " << seed << ": the schedule never passed the limit";
    EXPECT_TRUE(matching(lines, "log_records_dropped").empty()) << "the log's queue overflowed: the count says nothing";
  }
}

}  // namespace
}  // namespace shoal::testing
