// Preemption (lender_config::preempt_after): once the borrow at the head of
// the waiting line has waited long enough and the capacity has no room for
// it, the lender revokes regions of other borrowers for it — lent longest ago
// first, only as many as the shortfall needs, never shared ones nor those of
// borrowers that wait themselves — and revokes others when a borrower lets
// the deadline pass: the next model's turn without an operator (host backend).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <unistd.h>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "lending/preemption.h"
#include "support/sanitized.h"
#include "shoal/channel/protocol.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/child_process.h"
#include "shoal/core/error.h"
#include "support/other_uids.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

using lending::borrow_wait;
using lending::borrowed_region;
using lending::region_mode;
using lending::detail::choose_preempted;
using lending::detail::preemption_candidate;

constexpr auto answer_timeout = std::chrono::seconds(5);

struct preemption_fixture : waiting_line {
  using waiting_line::waiting_line;
  std::future<borrowed_region> borrow_waiting(borrower& b, std::size_t bytes, std::chrono::milliseconds wait) {
    return waiting_line::borrow_waiting(b, bytes, "the next model", wait);
  }
  // The ids of the regions being revoked now.
  std::vector<std::uint64_t> revoking() const {
    std::vector<std::uint64_t> ids;
    for (const auto& r : l->status().regions) {
      if (r.state == lending::region_state::revoking) ids.push_back(r.id);
    }
    return ids;
  }
};

std::vector<std::uint64_t> ids_of(const std::vector<borrower::revocation>& revocations) {
  std::vector<std::uint64_t> ids;
  for (const auto& r : revocations) ids.push_back(r.region);
  return ids;
}

TEST(lending_preemption_choice, takes_the_regions_lent_longest_ago_until_the_shortfall_is_covered) {
  const auto t0 = std::chrono::steady_clock::time_point{} + 1h;
  const std::vector<preemption_candidate> candidates = {
      {1, 4 * mib, t0 + 2s}, {2, 2 * mib, t0}, {3, 2 * mib, t0 + 1s}, {4, 8 * mib, t0 + 3s}};
  const auto choose = [&](std::size_t shortfall) { return choose_preempted(candidates, shortfall, 0, {}); };
  EXPECT_EQ(choose(2 * mib), (std::vector<std::uint64_t>{2}));
  EXPECT_EQ(choose(3 * mib), (std::vector<std::uint64_t>{2, 3}));
  EXPECT_EQ(choose(5 * mib), (std::vector<std::uint64_t>{2, 3, 1}));
  EXPECT_EQ(choose(16 * mib), (std::vector<std::uint64_t>{2, 3, 1, 4}));
  EXPECT_TRUE(choose(16 * mib + 1).empty()) << "revoked what cannot serve the head";
  EXPECT_TRUE(choose(0).empty());
  // Lent at the same moment: the larger first.
  EXPECT_EQ(choose_preempted({{5, 2 * mib, t0}, {6, 4 * mib, t0}}, 1, 0, {}), (std::vector<std::uint64_t>{6}));
}

// Across uids a region is taken only while its uid still holds more than
// the head's, counting what the choice has moved so far: holdings are
// evened out at most.
TEST(lending_preemption_choice, takes_from_another_uid_only_while_it_holds_more) {
  const auto t0 = std::chrono::steady_clock::time_point{} + 1h;
  constexpr uid_t head = 1000, other = 2000;
  const std::vector<preemption_candidate> others = {
      {1, 2 * mib, t0, other}, {2, 2 * mib, t0 + 1s, other}, {3, 2 * mib, t0 + 2s, other}};
  // uid 2000 holds 6 MiB, the head's uid 2: one region evens them (4 and 4),
  // a second would not be taken — 6 MiB short is not served, 2 MiB short is.
  EXPECT_TRUE(choose_preempted(others, 6 * mib, head, {{other, 6 * mib}, {head, 2 * mib}}).empty())
      << "took a uid down below the head's";
  EXPECT_EQ(choose_preempted(others, 2 * mib, head, {{other, 6 * mib}, {head, 2 * mib}}),
            (std::vector<std::uint64_t>{1}));
  // Holding no more than the head's uid: nothing of it is taken.
  EXPECT_TRUE(choose_preempted(others, 2 * mib, head, {{other, 6 * mib}, {head, 6 * mib}}).empty());
  // The head's own uid (its other connections) has no such rule.
  const std::vector<preemption_candidate> own = {{4, 2 * mib, t0, head}, {5, 2 * mib, t0 + 1s, head}};
  EXPECT_EQ(choose_preempted(own, 4 * mib, head, {{head, 4 * mib}}), (std::vector<std::uint64_t>{4, 5}));
  // Skipped regions of a uid leave the others to cover: the oldest of
  // uid 2000 is passed over once it would be taken below the head's.
  std::vector<preemption_candidate> mixed = others;
  mixed.push_back({6, 2 * mib, t0 + 3s, head});
  EXPECT_EQ(choose_preempted(mixed, 4 * mib, head, {{other, 6 * mib}, {head, 4 * mib}}),
            (std::vector<std::uint64_t>{1, 6}));
}

TEST(lending_preemption, is_off_unless_configured) {
  preemption_fixture f({.capacity_bytes = 8 * mib});
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address());
  auto a = model_a.borrow(8 * mib, "model A");
  EXPECT_THROW((void)model_b.borrow(4 * mib, "model B", region_mode::exclusive, answer_timeout,
                                    borrow_wait{300ms, {}}),
               out_of_memory);
  EXPECT_TRUE(model_a.revocations().empty());
  EXPECT_EQ(f.l->status().revocations, 0u);
}

TEST(lending_preemption, revokes_the_oldest_regions_the_shortfall_needs_and_serves_the_head) {
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 0ms, .preempt_deadline = 5s});
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address());
  auto parameters = model_a.borrow(2 * mib, "model A parameters");
  auto activations = model_a.borrow(4 * mib, "model A activations");
  auto b = f.borrow_waiting(model_b, 4 * mib, 10s);  // 2 MiB free: 2 short
  const auto asked = model_a.revocations(2s);
  ASSERT_EQ(ids_of(asked), (std::vector<std::uint64_t>{parameters.id()})) << "not the oldest region alone";
  EXPECT_GT(asked[0].deadline, std::chrono::steady_clock::now() + 3s) << "not the configured deadline";
  // The region on its way back counts: at later checks no more is revoked.
  std::this_thread::sleep_for(200ms);
  EXPECT_TRUE(model_a.revocations().empty());
  EXPECT_EQ(f.revoking(), (std::vector<std::uint64_t>{parameters.id()}));
  auto s = f.l->status();
  EXPECT_EQ(s.revocations, 1u);
  EXPECT_EQ(s.preemptions, 1u);
  EXPECT_NE(f.l->metrics_text().find("shoal_lending_preemptions_total 1\n"), std::string::npos);
  {
    std::lock_guard lock(*f.recorder.guard);
    EXPECT_TRUE(std::any_of(f.recorder.events->begin(), f.recorder.events->end(), [](const lending::lender_event& e) {
      return e.what == lending::lender_event::kind::revoke_requested &&
             e.detail.find("preempted for the borrow of " + std::to_string(4 * mib) + " bytes") != std::string::npos;
    })) << "the log does not say why";
  }

  model_a.give_back(std::move(parameters));
  ASSERT_EQ(b.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(b.get().valid()) << "the next model's turn";
  EXPECT_TRUE(activations.valid());
}

TEST(lending_preemption, waits_preempt_after_before_it_revokes) {
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 400ms});
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address());
  auto a = model_a.borrow(8 * mib, "model A");
  const auto start = std::chrono::steady_clock::now();
  auto b = f.borrow_waiting(model_b, 8 * mib, 10s);
  ASSERT_TRUE(f.waiting(1));
  // The head began waiting after `start`: no revoke before start + 400 ms
  // (looked for until start + 350 ms, when this thread is not later).
  const auto quiet =
      std::chrono::duration_cast<std::chrono::milliseconds>(start + 350ms - std::chrono::steady_clock::now());
  if (quiet > 0ms) EXPECT_TRUE(model_a.revocations(quiet).empty()) << "revoked before the head waited preempt_after";
  ASSERT_EQ(model_a.revocations(2s).size(), 1u);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 400ms);
  model_a.give_back(std::move(a));
  ASSERT_EQ(b.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(b.get().valid());
}

// Each new head is looked at as soon as it waits (preempt_after 0), not at
// the next periodic check after the last head's: turns back to back take
// about a round trip each, not 50 ms.
TEST(lending_preemption, models_take_turns_back_to_back) {
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 0ms});
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address());
  borrower* holder = &model_a;
  borrower* next = &model_b;
  auto held = holder->borrow(8 * mib, "a turn");
  constexpr int turns = 20;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < turns; ++i) {
    auto lent = f.borrow_waiting(*next, 8 * mib, 10s);
    ASSERT_EQ(holder->revocations(2s).size(), 1u) << "turn " << i;
    holder->give_back(std::move(held));
    ASSERT_EQ(lent.wait_for(answer_timeout), std::future_status::ready) << "turn " << i;
    held = lent.get();
    std::swap(holder, next);
  }
  const auto took = std::chrono::steady_clock::now() - start;
  // One periodic check interval a turn would be about a second in all. Not
  // timed under a sanitizer: there a turn's own work costs about as much.
  if constexpr (!sanitized_build) {
    EXPECT_LT(took, 600ms) << turns << " turns took "
                           << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  }
  EXPECT_EQ(f.l->status().preemptions, static_cast<std::uint64_t>(turns));
}

TEST(lending_preemption, spares_shared_regions_and_the_heads_own) {
  // 8 MiB: a shared region (2), the head's own (2), another model's (2),
  // lent in that order; 2 free.
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 0ms});
  borrower writer(f.dev, f.l->address()), head(f.dev, f.l->address()), other(f.dev, f.l->address());
  auto shared = writer.borrow(2 * mib, "weights");
  lending::region_layout layout;
  layout.entries = {{"w", 0, shared.size(), lending::dtype::uint8, {shared.size()}}};
  layout.hash = lending::hash_entries(f.dev, shared.data(), shared.size(), layout);
  shared = writer.publish(std::move(shared), layout);
  auto head_own = head.borrow(2 * mib, "head");
  auto others = other.borrow(2 * mib, "other model");
  auto first = f.borrow_waiting(head, 4 * mib, 10s);  // 2 short
  ASSERT_EQ(ids_of(other.revocations(2s)), (std::vector<std::uint64_t>{others.id()}));
  EXPECT_EQ(f.revoking(), (std::vector<std::uint64_t>{others.id()})) << "an older region it may not take was revoked";
  other.give_back(std::move(others));
  ASSERT_EQ(first.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(first.get().valid());
}

// A borrower cannot shield its regions by keeping a borrow waiting behind
// the head: its wait ends (stopped_waiting), then its region is revoked.
TEST(lending_preemption, takes_a_region_of_a_borrower_waiting_behind_after_ending_its_wait) {
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 300ms});
  borrower behind(f.dev, f.l->address()), other(f.dev, f.l->address()), head(f.dev, f.l->address());
  auto behind_own = behind.borrow(2 * mib, "behind");  // the oldest
  auto others = other.borrow(4 * mib, "other model");
  auto first = f.borrow_waiting(head, 4 * mib, 10s);  // 2 free: 2 short
  ASSERT_TRUE(f.waiting(1));
  auto second = f.borrow_waiting(behind, 2 * mib, 10s);
  ASSERT_TRUE(f.waiting(2));
  ASSERT_EQ(second.wait_for(answer_timeout), std::future_status::ready) << "its wait did not end";
  try {
    (void)second.get();
    ADD_FAILURE() << "lent while it was to give back";
  } catch (const lending::memory_refused& e) {
    EXPECT_EQ(e.reason(), lending::shortage::stopped_waiting) << e.what();
    EXPECT_NE(std::string(e.what()).find("preempted"), std::string::npos) << e.what();
  }
  ASSERT_EQ(ids_of(behind.revocations(2s)), (std::vector<std::uint64_t>{behind_own.id()}));
  EXPECT_TRUE(other.revocations().empty()) << "a newer region was taken while the oldest was shielded";
  behind.give_back(std::move(behind_own));
  ASSERT_EQ(first.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(first.get().valid());
}

// A region being revoked from a borrower whose own borrow waits cannot come
// back meanwhile: it does not count as coming, and others are revoked.
TEST(lending_preemption, a_revoked_region_of_a_waiting_borrower_does_not_count_as_coming) {
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 300ms});
  borrower behind(f.dev, f.l->address()), other(f.dev, f.l->address()), head(f.dev, f.l->address());
  auto behind_own = behind.borrow(2 * mib, "behind");
  auto others = other.borrow(2 * mib, "other model");
  auto first = f.borrow_waiting(head, 6 * mib, 10s);  // 4 free: 2 short
  ASSERT_TRUE(f.waiting(1));
  auto second = f.borrow_waiting(behind, 2 * mib, 10s);
  ASSERT_TRUE(f.waiting(2));
  f.l->revoke(behind_own.id(), 5s);  // the operator's, while it waits
  ASSERT_EQ(ids_of(other.revocations(2s)), (std::vector<std::uint64_t>{others.id()}));
  other.give_back(std::move(others));
  ASSERT_EQ(first.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(first.get().valid());
}

// One asked to give a region back (by preemption or the operator) may not
// wait for memory until it has: while it waited it could give nothing back.
TEST(lending_preemption, a_borrower_asked_to_give_back_may_not_wait) {
  preemption_fixture f({.capacity_bytes = 8 * mib});
  borrower holder(f.dev, f.l->address()), other(f.dev, f.l->address());
  auto held = holder.borrow(4 * mib, "model A");
  auto others = other.borrow(4 * mib, "model B");
  f.l->revoke(held.id(), 5s);
  ASSERT_EQ(holder.revocations(2s).size(), 1u);
  try {
    (void)holder.borrow(2 * mib, "more", region_mode::exclusive, answer_timeout, borrow_wait{5s, {}});
    ADD_FAILURE() << "lent";
  } catch (const lending::memory_refused& e) {
    EXPECT_EQ(e.reason(), lending::shortage::cannot_fit) << e.what();
    EXPECT_NE(std::string(e.what()).find("asked to give region " + std::to_string(held.id()) + " back"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(f.l->status().waiting.empty());
}

// A borrow that waited behind the one just served becomes the head with an
// old wait: the region just lent is still kept preempt_after (no turn is
// taken the moment it began).
TEST(lending_preemption, keeps_each_region_preempt_after_at_least) {
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 300ms, .preempt_deadline = 5s});
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address()), model_c(f.dev, f.l->address());
  auto a = model_a.borrow(8 * mib, "model A");
  auto b = f.borrow_waiting(model_b, 8 * mib, 10s);
  ASSERT_TRUE(f.waiting(1));
  auto c = f.borrow_waiting(model_c, 8 * mib, 10s);
  ASSERT_TRUE(f.waiting(2));
  ASSERT_EQ(model_a.revocations(2s).size(), 1u);
  // The lender lends B's region once this give back came: B's revoke comes
  // preempt_after (300 ms) after `given_back` at the earliest, however late
  // this thread sees the loan.
  const auto given_back = std::chrono::steady_clock::now();
  model_a.give_back(std::move(a));
  ASSERT_EQ(b.wait_for(answer_timeout), std::future_status::ready);
  auto b_region = b.get();
  const auto quiet = std::chrono::duration_cast<std::chrono::milliseconds>(given_back + 250ms -
                                                                           std::chrono::steady_clock::now());
  if (quiet > 0ms) EXPECT_TRUE(model_b.revocations(quiet).empty()) << "a region just lent was preempted";
  ASSERT_EQ(ids_of(model_b.revocations(2s)), (std::vector<std::uint64_t>{b_region.id()}));
  EXPECT_GE(std::chrono::steady_clock::now() - given_back, 300ms);
  model_b.give_back(std::move(b_region));
  ASSERT_EQ(c.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(c.get().valid());
}

// Across uids the lender takes only from a uid holding more than the
// head's: a borrower does not take from one that holds as little as it does.
// A lender of 8 MiB that preempts at once and admits uid 65534, whose
// borrower process holds the oldest region, 2 MiB (the tests need root).
struct lender_with_another_uid {
  static constexpr uid_t nobody = 65534;
  std::string name = "shoal-preemption-uid-test-" + std::to_string(::getpid());
  backend::device& dev = backend::host_device_instance();
  lender l{dev, channel::channel_address::abstract(name),
           {.capacity_bytes = 8 * mib, .preempt_after = 0ms, .policy = channel::access_policy{{nobody}, {}}}};
  child_process holding = nobodys("wait-borrow", {std::to_string(2 * mib), "30000"});
  std::string lent = line_from(holding);  // "lent <its region>"

  // A borrower process of uid 65534 running `command` with `args`.
  child_process nobodys(const std::string& command, std::vector<std::string> args) const {
    args.insert(args.begin(), {command, "host", "@" + name});
    args.emplace_back("nobody");
    return child_process(SHOAL_TEST_BORROWER, args);
  }
};

TEST(lending_preemption, takes_from_another_uid_only_while_it_holds_more) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  lender_with_another_uid f;
  lender& l = f.l;
  ASSERT_EQ(f.lent.rfind("lent ", 0), 0u) << f.lent;
  const std::uint64_t smalls = std::stoull(f.lent.substr(5));
  borrower holder(f.dev, l.address()), head(f.dev, l.address());
  auto held = holder.borrow(6 * mib, "this uid's model");
  auto first = std::async(std::launch::async, [&] {
    return head.borrow(2 * mib, "this uid's next model", region_mode::exclusive, answer_timeout,
                       borrow_wait{10s, {}});
  });
  ASSERT_EQ(ids_of(holder.revocations(2s)), (std::vector<std::uint64_t>{held.id()}))
      << "not this uid's own region";
  const auto s = l.status();
  for (const auto& r : s.regions) {
    if (r.id == smalls) EXPECT_EQ(r.state, lending::region_state::lent) << "uid 65534, holding less, was preempted";
  }
  holder.give_back(std::move(held));
  ASSERT_EQ(first.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(first.get().valid());
}

// A uid's spares kept mapped count as its holdings: uid 65534 holding a
// region of 2 MiB and keeping a spare of 2 MiB mapped holds more than this
// uid's 2 MiB, so its region is taken rather than this uid's own (which is
// what the choice falls back to were the spare left out).
TEST(lending_preemption, counts_the_spares_a_uid_keeps_mapped_as_what_it_holds) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  lender_with_another_uid f;
  lender& l = f.l;
  auto& dev = f.dev;
  ASSERT_EQ(f.lent.rfind("lent ", 0), 0u) << f.lent;
  const std::uint64_t theirs = std::stoull(f.lent.substr(5));
  child_process keeping = f.nobodys("cycle", {std::to_string(2 * mib), "1"});
  const std::string cycled = line_from(keeping);  // borrowed and given back, its mapping kept
  ASSERT_NE(cycled.find("kept 1"), std::string::npos) << cycled;
  ASSERT_EQ(l.status().spare_bytes, 2 * mib);
  borrower holder(dev, l.address()), head(dev, l.address());
  auto ours = holder.borrow(2 * mib, "this uid's model");
  // 8 MiB: 4 lent, 2 spare; 6 asked: 2 short even with the spare released.
  auto first = std::async(std::launch::async, [&] {
    try {
      (void)head.borrow(6 * mib, "this uid's next model", region_mode::exclusive, answer_timeout,
                        borrow_wait{1s, {}});
    } catch (const lending::memory_refused&) {  // NOLINT(bugprone-empty-catch): the region revoked is never given back
    }
  });
  const auto deadline = std::chrono::steady_clock::now() + 1s;
  std::vector<std::uint64_t> revoked;
  while (revoked.empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
    for (const auto& r : l.status().regions) {
      if (r.state == lending::region_state::revoking) revoked.push_back(r.id);
    }
  }
  EXPECT_EQ(revoked, (std::vector<std::uint64_t>{theirs}))
      << "uid 65534 holds 4 MiB with its spare, this uid 2: its region, the oldest, is the one to take";
  EXPECT_TRUE(holder.revocations().empty()) << "this uid's own region was taken while uid 65534 held more";
  first.wait();
}

// When the lender's heap runs out while it preempts, the regions it chose
// are marked to be revoked all together or not at all: a region marked alone
// would wait, unrevoked in all but name, for a later look. Each round refuses
// one more allocation of the serving thread (the first refusal lands on the
// n-th allocation of the preemption: nothing else runs there meanwhile), and
// the test reads the regions being revoked meanwhile; the sweep ends with
// the first round that refused nothing.
TEST(lending_preemption, marks_all_the_regions_it_chose_or_none_when_host_memory_runs_out) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  int rounds = 0;
  for (int period = 1; period <= 200; ++period, ++rounds) {
    lender_config config{.capacity_bytes = 8 * mib, .preempt_after = 30ms};
    config.on_event = [](const lending::lender_event&) { refusing_allocations_elsewhere::join(); };
    lender l(dev, channel::channel_address::at_path(dir / ("l" + std::to_string(period) + ".sock")), config);
    borrower holder(dev, l.address(), channel::access_policy{}, 2000ms), head(dev, l.address());
    std::vector<borrowed_region> held;
    for (int i = 0; i < 4; ++i) held.push_back(holder.borrow(2 * mib, "model A"));  // lent oldest first
    const std::vector<std::uint64_t> chosen{held[0].id(), held[1].id()};
    std::atomic<bool> give_up{false};
    auto next = std::async(std::launch::async, [&] {
      return head.borrow(4 * mib, "model B", region_mode::exclusive, answer_timeout, borrow_wait{3s, [&] {
                           if (give_up) throw std::runtime_error("the round is over");
                         }});
    });
    ASSERT_TRUE(eventually([&] { return l.status().waiting.size() == 1; }));
    int refused = 0;
    {
      const refusing_allocations_elsewhere some(period);
      const auto until = std::chrono::steady_clock::now() + 100ms;
      while (std::chrono::steady_clock::now() < until) {
        std::vector<std::uint64_t> revoking;
        for (const auto& r : l.status().regions) {
          if (r.state == lending::region_state::revoking) revoking.push_back(r.id);
        }
        std::sort(revoking.begin(), revoking.end());
        ASSERT_TRUE(revoking.empty() || revoking == chosen)
            << "period " << period << ": " << revoking.size() << " of the 2 regions chosen marked";
        std::this_thread::sleep_for(1ms);
      }
      refused = refusing_allocations_elsewhere::refused();
    }
    // Memory back: the next look revokes both, unless a refused send closed
    // the holder's connection (its regions then stay with this live process).
    try {
      std::vector<std::uint64_t> ids;  // the two revokes may come apart
      const auto deadline = std::chrono::steady_clock::now() + 2s;
      while (ids.size() < chosen.size() && std::chrono::steady_clock::now() < deadline) {
        for (const std::uint64_t id : ids_of(holder.revocations(100ms))) ids.push_back(id);
      }
      std::sort(ids.begin(), ids.end());
      EXPECT_EQ(ids, chosen) << "period " << period;
      holder.give_back(std::move(held[0]));
      holder.give_back(std::move(held[1]));
      ASSERT_EQ(next.wait_for(answer_timeout), std::future_status::ready) << "period " << period;
      EXPECT_TRUE(next.get().valid()) << "period " << period;
    } catch (const error&) {  // closed for the lender's lack of memory
      give_up = true;  // its regions stay with this live process: the head is not served
    }
    if (refused == 0) break;  // past the preemption's last allocation
  }
  EXPECT_GT(rounds, 3) << "the preemption allocated too little for the sweep to mean anything";
  EXPECT_LT(rounds, 200) << "no round ran the preemption without a refusal";
}

TEST(lending_preemption, revokes_nothing_when_all_it_may_revoke_would_not_serve_the_head) {
  preemption_fixture f({.capacity_bytes = 8 * mib, .preempt_after = 0ms});
  borrower holder(f.dev, f.l->address()), waiter(f.dev, f.l->address());
  auto held = holder.borrow(2 * mib, "model A");
  {
    // A connection borrows and hangs up while its process (this one) runs:
    // its region stays, orphaned, and cannot be revoked.
    auto raw = channel::connection::connect(f.l->address(), {});
    channel::send_hello(raw, lending::detail::lending_protocol);
    (void)raw.receive_for(2000ms);
    raw.send(static_cast<std::uint16_t>(lending::detail::message_type::borrow),
             lending::detail::encode(lending::detail::borrow_message{1, 4 * mib, region_mode::exclusive, "x"}));
    ASSERT_EQ(raw.receive_for(2000ms).type, static_cast<std::uint16_t>(lending::detail::message_type::lent));
  }
  ASSERT_TRUE(eventually([&] {
    const auto s = f.l->status();
    return std::any_of(s.regions.begin(), s.regions.end(),
                       [](const auto& r) { return r.state == lending::region_state::orphaned; });
  }));
  EXPECT_THROW((void)waiter.borrow(6 * mib, "the next model", region_mode::exclusive, answer_timeout,
                                   borrow_wait{300ms, {}}),
               out_of_memory);  // 4 short; model A's 2 cannot cover it
  EXPECT_TRUE(holder.revocations().empty()) << "revoked a region that could not serve the head";
  EXPECT_EQ(f.l->status().revocations, 0u);
}

TEST(lending_preemption, revokes_others_when_a_borrower_lets_the_deadline_pass) {
  preemption_fixture f({.capacity_bytes = 4 * mib, .preempt_after = 0ms, .preempt_deadline = 300ms});
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address()), model_c(f.dev, f.l->address());
  auto a = model_a.borrow(2 * mib, "model A");
  auto b = model_b.borrow(2 * mib, "model B");
  auto c = f.borrow_waiting(model_c, 2 * mib, 10s);
  ASSERT_EQ(ids_of(model_a.revocations(2s)), (std::vector<std::uint64_t>{a.id()}));  // model A does not answer
  EXPECT_TRUE(model_b.revocations(100ms).empty()) << "revoked more while model A's deadline runs";
  ASSERT_EQ(ids_of(model_b.revocations(2s)), (std::vector<std::uint64_t>{b.id()}));
  // Named late at the periodic check, which may come just after the next revoke.
  EXPECT_TRUE(eventually([&] { return f.l->status().revocations_missed == 1; }));
  EXPECT_EQ(f.l->status().preemptions, 2u);
  model_b.give_back(std::move(b));
  ASSERT_EQ(c.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(c.get().valid());
  EXPECT_TRUE(a.valid()) << "model A keeps its region, named late";
}

TEST(lending_preemption, refuses_a_config_out_of_range) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  const auto address = channel::channel_address::at_path(dir / "l.sock");
  EXPECT_THROW(lender(dev, address, {.preempt_after = -1ms}), invalid_argument);
  EXPECT_THROW(lender(dev, address, {.preempt_deadline = 0ms}), invalid_argument);
  EXPECT_THROW(lender(dev, address, {.max_wait = 1s, .preempt_after = 1s}), invalid_argument);
  EXPECT_NO_THROW(lender(dev, address, {.max_wait = 1s, .preempt_after = 999ms}));
  EXPECT_THROW(lender(dev, address, {.preempt_deadline = std::chrono::milliseconds(std::int64_t{1} << 33)}),
               invalid_argument);
}

// Across processes on each backend (CUDA imports only in another process):
// a holder process that answers revokes is preempted for a waiting process,
// which is lent the memory as the holder gives it back.
template <class Backend>
class preemption_processes : public lending_test<Backend> {};
TYPED_TEST_SUITE(preemption_processes, backend_types, backend_names);

TYPED_TEST(preemption_processes, a_holder_process_is_preempted_for_a_waiting_process) {
  auto& l = this->start({.capacity_bytes = 4 * mib, .preempt_after = 0ms, .preempt_deadline = 5s});
  auto holder = this->borrower_process({"yield", std::to_string(4 * mib), "91"});
  const std::string held = line_from(*holder);
  ASSERT_EQ(held.rfind("held ", 0), 0u) << held;
  auto waiter = this->borrower_process({"wait-borrow", std::to_string(4 * mib), "30000"});
  EXPECT_EQ(line_from(*holder), "yielded " + held.substr(5));
  const std::string lent = line_from(*waiter);
  EXPECT_EQ(lent.rfind("lent ", 0), 0u) << lent;
  const auto s = l.status();
  EXPECT_EQ(s.preemptions, 1u);
  EXPECT_EQ(s.revocations_missed, 0u);
  EXPECT_EQ(s.lent_bytes, 4 * mib);
}

}  // namespace
}  // namespace shoal::testing
