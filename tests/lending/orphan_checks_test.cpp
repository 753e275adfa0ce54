// The lender's reclaim looks up a bounded number of processes with orphaned
// holds a pass, each once, going round all of them in turn.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <set>
#include <utility>
#include <vector>

#include "lending/orphan_checks.h"

namespace shoal::testing {
namespace {

using lending::detail::orphan_checks;

std::vector<process_identity> processes(int n, int repeats = 1) {
  std::vector<process_identity> out;
  for (int r = 0; r < repeats; ++r) {
    for (int i = n; i > 0; --i) out.push_back({static_cast<pid_t>(1000 + i), static_cast<std::uint64_t>(7 * i)});
  }
  return out;
}

std::set<std::pair<pid_t, std::uint64_t>> as_set(const std::vector<process_identity>& v) {
  std::set<std::pair<pid_t, std::uint64_t>> out;
  for (const auto& p : v) out.emplace(p.pid, p.start_time);
  return out;
}

TEST(orphan_checks, a_pass_looks_up_at_most_its_bound_each_process_once) {
  orphan_checks checks(64);
  auto holders = processes(1000, 3);  // each process holds three regions
  const auto chosen = checks.next(holders);
  EXPECT_EQ(chosen.size(), 64u);
  EXPECT_EQ(as_set(chosen).size(), 64u) << "a process was looked up twice in one pass";
}

TEST(orphan_checks, passes_go_round_every_process_in_turn) {
  orphan_checks checks(64);
  std::vector<process_identity> seen;
  for (int pass = 0; pass < 16; ++pass) {  // ceil(1000 / 64) passes
    auto holders = processes(1000, 2);
    const auto chosen = checks.next(holders);
    seen.insert(seen.end(), chosen.begin(), chosen.end());
  }
  EXPECT_EQ(as_set(seen).size(), 1000u) << "some process was never looked up";
  auto holders = processes(1000);
  const auto after_the_round = checks.next(holders);
  ASSERT_FALSE(after_the_round.empty());
  EXPECT_EQ(after_the_round.front().pid, seen.back().pid + 1) << "a pass starts after the last one looked up";
}

TEST(orphan_checks, fewer_processes_than_the_bound_are_all_looked_up_each_pass) {
  orphan_checks checks(64);
  for (int pass = 0; pass < 3; ++pass) {
    auto holders = processes(10, 4);
    EXPECT_EQ(as_set(checks.next(holders)).size(), 10u);
  }
}

TEST(orphan_checks, a_process_that_left_the_list_does_not_stop_the_round) {
  orphan_checks checks(2);
  auto holders = processes(5);
  const auto first = checks.next(holders);  // 1001, 1002
  ASSERT_EQ(first.size(), 2u);
  // 1002 (the last looked up) has exited and was dropped: the round goes on after it.
  std::vector<process_identity> left;
  for (const auto& p : processes(5)) {
    if (p.pid != 1002) left.push_back(p);
  }
  const auto second = checks.next(left);
  ASSERT_EQ(second.size(), 2u);
  EXPECT_EQ(second[0].pid, 1003);
  EXPECT_EQ(second[1].pid, 1004);
}

}  // namespace
}  // namespace shoal::testing
