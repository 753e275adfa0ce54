// A borrow that waits for memory (borrow_wait::for_memory): the lender keeps
// a borrow that does not fit in line and serves it as regions are given
// back — the next model's turn without a retry loop — in the order the
// borrows came, refusing each whose wait runs out; a borrower that hangs up,
// cancels, or sends anything else leaves the line, its answers in the order
// asked. An interrupt check ends a borrower's wait early, and the borrower
// tells the lender (host backend).
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <chrono>
#include <future>
#include <thread>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "support/forwarding_device.h"
#include "support/other_uids.h"
#include "support/refused_allocations.h"
#include "shoal/backend/host_device.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using lending::detail::message_type;
using lending::borrow_wait;
using lending::borrowed_region;
using lending::region_mode;

constexpr auto answer_timeout = std::chrono::seconds(5);

struct waiting_fixture : waiting_line {
  explicit waiting_fixture(std::size_t capacity) : waiting_line({.capacity_bytes = capacity}) {}
};

TEST(lending_waiting_borrow, is_served_when_memory_is_given_back) {
  waiting_fixture f(8 * mib);
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address());
  auto a = model_a.borrow(8 * mib, "model A");
  auto b = f.borrow_waiting(model_b, 8 * mib, "model B", 10s);
  ASSERT_TRUE(f.waiting(1));
  const auto status = f.l->status();
  EXPECT_EQ(status.waiting[0].bytes, 8 * mib);
  EXPECT_EQ(status.waiting[0].purpose, "model B");
  EXPECT_EQ(status.waiting[0].borrower.pid, ::getpid());
  EXPECT_GT(status.waiting[0].left, std::chrono::seconds(5));
  const std::string text = f.l->metrics_text();
  EXPECT_NE(text.find("shoal_lending_waiting_borrows 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("shoal_lending_waiting_borrow_bytes{place=\"0\",pid=\"" + std::to_string(::getpid())),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("shoal_lending_waiting_borrow_waited_seconds{place=\"0\",pid=\"" + std::to_string(::getpid())),
            std::string::npos)
      << text;
  EXPECT_EQ(b.wait_for(100ms), std::future_status::timeout) << "served while model A holds the memory";

  const auto given_back = std::chrono::steady_clock::now();
  model_a.give_back(std::move(a));
  ASSERT_EQ(b.wait_for(answer_timeout), std::future_status::ready);
  const auto region = b.get();
  EXPECT_TRUE(region.valid());
  EXPECT_LT(std::chrono::steady_clock::now() - given_back, 3s) << "served when the memory came back, not later";
  const auto after = f.l->status();
  EXPECT_EQ(after.waits, 1u);
  EXPECT_TRUE(after.waiting.empty()) << "the lent borrow stayed in line";
  std::lock_guard lock(*f.recorder.guard);
  EXPECT_TRUE(std::any_of(f.recorder.events->begin(), f.recorder.events->end(), [](const lending::lender_event& e) {
    return e.what == lending::lender_event::kind::waiting && e.bytes == 8 * mib;
  })) << "the wait is in the lender's log";
}

// The lender's `lent` event comes on its serving thread after the answer is
// posted: status read there is what a borrower whose borrow just returned
// reads. It shows the borrow lent and out of the line, never both.
TEST(lending_waiting_borrow, status_never_shows_a_borrow_lent_and_still_waiting) {
  std::atomic<lender*> serving{nullptr};
  std::mutex guard;
  std::vector<std::pair<std::size_t, std::size_t>> seen_when_lent;  // (regions, borrows waiting)
  lender_config config{.capacity_bytes = 8 * mib};
  config.on_event = [&](const lending::lender_event& e) {
    lender* l = serving.load();
    if (l == nullptr || e.what != lending::lender_event::kind::lent) return;
    const auto status = l->status();
    std::lock_guard lock(guard);
    seen_when_lent.emplace_back(status.regions.size(), status.waiting.size());
  };
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), config);
  serving = &l;
  borrower model_a(dev, l.address()), model_b(dev, l.address());
  auto a = model_a.borrow(8 * mib, "model A");
  auto b = std::async(std::launch::async, [&] {
    return model_b.borrow(8 * mib, "model B", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}});
  });
  ASSERT_TRUE(eventually([&] { return l.status().waiting.size() == 1; }));
  model_a.give_back(std::move(a));
  ASSERT_EQ(b.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(b.get().valid());
  ASSERT_TRUE(eventually([&] {  // the event comes after the answer
    std::lock_guard lock(guard);
    return seen_when_lent.size() == 2;
  }));
  std::lock_guard lock(guard);
  using seen = std::pair<std::size_t, std::size_t>;
  EXPECT_EQ(seen_when_lent, (std::vector<seen>{{1, 0}, {1, 0}})) << "(regions, waiting) when each was lent";
}

TEST(lending_waiting_borrow, takes_turns_with_the_operators_revoke) {
  waiting_fixture f(8 * mib);
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address()), operator_(f.dev, f.l->address());
  auto a = model_a.borrow(8 * mib, "model A");
  auto b = f.borrow_waiting(model_b, 8 * mib, "model B", 10s);
  ASSERT_TRUE(f.waiting(1));
  operator_.revoke(a.id(), 5s);
  ASSERT_EQ(model_a.revocations(5s).size(), 1u);
  model_a.give_back(std::move(a));  // model A's turn ends
  ASSERT_EQ(b.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(b.get().valid()) << "model B's turn";
}

TEST(lending_waiting_borrow, a_wait_that_runs_out_is_refused_and_the_borrower_goes_on) {
  waiting_fixture f(8 * mib);
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address());
  auto a = model_a.borrow(8 * mib, "model A");
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)model_b.borrow(4 * mib, "model B", region_mode::exclusive, answer_timeout, borrow_wait{300ms, {}});
    ADD_FAILURE() << "lent while model A holds the capacity";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("waited 300 ms"), std::string::npos) << e.what();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 2s) << "refused when the wait ran out, not at the borrower's own deadline";
  EXPECT_EQ(f.l->status().waits_expired, 1u);
  EXPECT_TRUE(f.l->status().waiting.empty());
  model_a.give_back(std::move(a));
  EXPECT_TRUE(model_b.borrow(4 * mib, "model B").valid()) << "the link stays in step";
}

TEST(lending_waiting_borrow, refusals_for_want_of_memory_say_which_shortage) {
  waiting_fixture f(8 * mib);
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address()), model_c(f.dev, f.l->address());
  const auto reason = [](borrower& b, std::size_t bytes, std::chrono::milliseconds wait) {
    try {
      (void)b.borrow(bytes, "refused", region_mode::exclusive, answer_timeout, borrow_wait{wait, {}});
    } catch (const lending::memory_refused& e) {
      EXPECT_EQ(e.requested_bytes(), bytes);
      return std::string(lending::to_string(e.reason()));
    }
    return std::string("lent");
  };
  EXPECT_EQ(reason(model_a, 9 * mib, 0ms), "cannot_fit");
  auto a = model_a.borrow(8 * mib, "model A");
  EXPECT_EQ(reason(model_b, 2 * mib, 0ms), "capacity");
  EXPECT_EQ(reason(model_b, 2 * mib, 100ms), "wait_expired");
  EXPECT_EQ(reason(model_a, 2 * mib, 5000ms), "cannot_fit") << "beside its own regions";
  auto c = f.borrow_waiting(model_c, 2 * mib, "model C", 10s);
  ASSERT_TRUE(f.waiting(1));
  EXPECT_EQ(reason(model_b, 2 * mib, 0ms), "others_waiting");
  model_a.give_back(std::move(a));
  ASSERT_EQ(c.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(c.get().valid());
}

TEST(lending_waiting_borrow, borrows_are_served_in_the_order_they_came) {
  waiting_fixture f(8 * mib);
  borrower holder(f.dev, f.l->address()), first(f.dev, f.l->address()), second(f.dev, f.l->address()),
      eager(f.dev, f.l->address());
  auto held = holder.borrow(6 * mib, "held");  // 2 MiB stay free
  auto big = f.borrow_waiting(first, 4 * mib, "first", 10s);
  ASSERT_TRUE(f.waiting(1));
  auto small = f.borrow_waiting(second, 2 * mib, "second", 10s);
  ASSERT_TRUE(f.waiting(2));
  EXPECT_EQ(small.wait_for(200ms), std::future_status::timeout)
      << "the second borrow fits the free 2 MiB but went ahead of the first";
  const auto line = f.l->status().waiting;
  EXPECT_EQ(line[0].purpose, "first");
  EXPECT_EQ(line[1].purpose, "second");
  try {
    (void)eager.borrow(2 * mib, "eager");
    ADD_FAILURE() << "a borrow without a wait took the memory the line waits for";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("wait for memory ahead of this one"), std::string::npos) << e.what();
  }
  holder.give_back(std::move(held));
  ASSERT_EQ(big.wait_for(answer_timeout), std::future_status::ready);
  ASSERT_EQ(small.wait_for(answer_timeout), std::future_status::ready);
  const auto big_region = big.get();
  const auto small_region = small.get();
  EXPECT_EQ(f.l->status().lent_bytes, 6 * mib) << "both waiting borrows were lent";
}

TEST(lending_waiting_borrow, what_can_never_fit_is_refused_at_once) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"),
           {.capacity_bytes = 8 * mib, .quota_bytes = 4 * mib});
  borrower b(dev, l.address());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)b.borrow(16 * mib, "past capacity", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}}),
               out_of_memory);
  EXPECT_THROW((void)b.borrow(6 * mib, "past quota", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}}),
               peer_refused);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "a borrow no give back can make fit waited";
  EXPECT_EQ(l.status().waits, 0u);
  EXPECT_THROW((void)b.borrow(mib, "x", region_mode::exclusive, answer_timeout, borrow_wait{-1ms, {}}),
               invalid_argument);
}

TEST(lending_waiting_borrow, a_wait_past_the_lenders_longest_is_cut_to_it) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), {.capacity_bytes = 8 * mib, .max_wait = 200ms});
  borrower holder(dev, l.address()), b(dev, l.address());
  auto held = holder.borrow(8 * mib, "held");
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)b.borrow(mib, "long wait", region_mode::exclusive, answer_timeout, borrow_wait{60s, {}});
    ADD_FAILURE() << "lent while the capacity is held";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("waited 200 ms (the lender's longest wait; 60000 asked)"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "a borrower held the line past the lender's longest wait";
  for (const auto bad : {0ms, -1ms}) {
    EXPECT_THROW(lender(dev, channel::channel_address::at_path(dir / "m.sock"), {.max_wait = bad}), invalid_argument);
  }
}

TEST(lending_waiting_borrow, what_waiting_cannot_make_fit_is_refused_at_once) {
  waiting_fixture f(8 * mib + 1);  // a capacity that is no multiple of the granularity
  borrower b(f.dev, f.l->address());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW((void)b.borrow(8 * mib + 1, "rounds past", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}}),
               out_of_memory)
      << "a borrow its rounding puts past the capacity";
  auto held = b.borrow(6 * mib, "held");
  try {
    (void)b.borrow(4 * mib, "beside its own", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}});
    ADD_FAILURE() << "lent past the capacity";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("waiting cannot make it fit"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "a borrow that can never be served waited";
  EXPECT_EQ(f.l->status().waits, 0u);
}

// A borrow past the capacity says the size asked for, and the rounded one
// only where rounding changed it.
TEST(lending_waiting_borrow, a_borrow_past_the_capacity_names_the_rounded_size_only_when_it_differs) {
  waiting_fixture f(8 * mib);
  borrower model(f.dev, f.l->address());
  const auto message = [&](std::size_t bytes) {
    try {
      (void)model.borrow(bytes, "too big");
    } catch (const lending::memory_refused& e) {
      return std::string(e.what());
    }
    return std::string("lent");
  };
  const std::string exact = message(10 * mib);
  EXPECT_NE(exact.find("10485760 bytes is more than the lender's capacity of 8388608"), std::string::npos) << exact;
  EXPECT_EQ(exact.find("rounded"), std::string::npos) << exact;
  const std::string rounded = message(10 * mib + 1);
  EXPECT_NE(rounded.find("10485761 bytes (" + std::to_string(10 * mib + f.dev.granularity()) +
                         " rounded up to the device's granularity) is more than"),
            std::string::npos)
      << rounded;
}

TEST(lending_waiting_borrow, a_head_that_cannot_fit_releases_no_spare) {
  waiting_fixture f(8 * mib);
  borrower holder(f.dev, f.l->address()), b(f.dev, f.l->address());
  holder.give_back(holder.borrow(2 * mib, "becomes a spare"));
  ASSERT_EQ(f.l->status().spares.size(), 1u);
  auto held = holder.borrow(4 * mib, "held");
  auto big = f.borrow_waiting(b, 8 * mib, "big", 10s);  // 4 MiB lent: 8 cannot fit, whatever is released
  ASSERT_TRUE(f.waiting(1));
  std::this_thread::sleep_for(200ms);  // a few periodic checks
  EXPECT_EQ(f.l->status().spares.size(), 1u) << "a spare was released for a borrow it could not make fit";
  holder.give_back(std::move(held));
  ASSERT_EQ(big.wait_for(answer_timeout), std::future_status::ready);
  const auto region = big.get();
  EXPECT_TRUE(f.l->status().spares.empty()) << "the spares go once releasing them makes the head fit";
}

// A device that refuses every chunk while `refuse` is set: its memory used
// by other processes, then freed.
class refusing_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  backend::physical_ref create_physical(std::size_t bytes) override {
    if (refuse.load()) throw out_of_memory("the device's memory is in use by other processes (test)", bytes);
    return forwarding_device::create_physical(bytes);
  }
  std::atomic<bool> refuse{true};
};

// The head the device refused (not the capacity: nothing given back would
// tell the lender) is tried again at each periodic check, so it is lent soon
// after other processes free the device's memory.
TEST(lending_waiting_borrow, a_head_the_device_refused_is_tried_again_at_the_periodic_check) {
  temp_dir dir;
  auto& host = backend::host_device_instance();
  refusing_device dev(host);
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), {.capacity_bytes = 8 * mib});
  borrower b(host, l.address());
  auto lent = std::async(std::launch::async, [&] {
    return b.borrow(2 * mib, "next", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}});
  });
  ASSERT_TRUE(eventually([&] { return l.status().waiting.size() == 1; }));
  EXPECT_EQ(lent.wait_for(200ms), std::future_status::timeout) << "lent while the device refused";
  dev.refuse.store(false);
  const auto freed = std::chrono::steady_clock::now();
  ASSERT_EQ(lent.wait_for(5s), std::future_status::ready) << "not tried again once the device had memory";
  EXPECT_TRUE(lent.get().valid());
  EXPECT_LT(std::chrono::steady_clock::now() - freed, 3s) << "served at a periodic check, not at the wait's end";
}

TEST(lending_waiting_borrow, regions_given_back_while_their_borrowers_borrow_waits_go_back_at_the_next_call) {
  waiting_fixture f(8 * mib);
  borrower holder(f.dev, f.l->address()), b(f.dev, f.l->address());
  auto held = holder.borrow(4 * mib, "held");
  auto dropped = b.borrow(2 * mib, "dropped");
  auto given = b.borrow(2 * mib, "given back");
  auto more = f.borrow_waiting(b, 2 * mib, "more", 10s);  // the capacity is lent: it waits, holding b's connection
  ASSERT_TRUE(f.waiting(1));
  const auto start = std::chrono::steady_clock::now();
  try {
    b.give_back(std::move(given), 300ms);
    ADD_FAILURE() << "given back through a connection a waiting borrow holds";
  } catch (const timeout_error& e) {
    EXPECT_NE(std::string(e.what()).find("given back at this borrower's next call"), std::string::npos) << e.what();
  }
  { auto gone = std::move(dropped); }  // the drop cannot use the connection either
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "a drop waited behind the waiting borrow";
  EXPECT_EQ(f.l->status().waiting.size(), 1u) << "the give backs ended the wait";
  holder.give_back(std::move(held));
  ASSERT_EQ(more.wait_for(answer_timeout), std::future_status::ready);
  const auto region = more.get();
  (void)b.metrics();  // the next call: the two give backs go
  EXPECT_TRUE(eventually([&] { return f.l->status().lent_bytes == 2 * mib; })) << "the regions dropped stayed lent";
}

// The waiting state both tests below start from: `count` regions of `b`
// given back while its borrow waited (their give backs deferred), then that
// borrow lent. Ten, so that owing their answers fills more than one block of
// the borrower's list of owed answers (an allocation between two sends).
struct deferred_give_backs {
  static constexpr std::size_t count = 10;
  waiting_fixture f{(2 + 2 * count) * mib};
  borrower holder{f.dev, f.l->address()};
  borrower b{f.dev, f.l->address()};
  borrowed_region more;

  deferred_give_backs() {
    auto held = holder.borrow(2 * mib, "held");
    std::vector<borrowed_region> regions;
    for (std::size_t i = 0; i < count; ++i) regions.push_back(b.borrow(2 * mib, "deferred"));
    auto waiting = f.borrow_waiting(b, 2 * mib, "more", 10s);  // the capacity is lent: it waits
    if (!f.waiting(1)) throw std::runtime_error("the borrow did not wait");
    // Deferred: the waiting borrow holds the connection (a drop would wait
    // for it 1 s before it defers; give_back waits its timeout).
    for (auto& r : regions) {
      try {
        b.give_back(std::move(r), 1ms);
      } catch (const timeout_error&) {  // NOLINT(bugprone-empty-catch): deferred, as it says
      }
    }
    holder.give_back(std::move(held));
    more = waiting.get();
  }
  // Whether every deferred give back reached the lender (only `more` lent).
  bool all_given_back() {
    return eventually([&] { return f.l->status().lent_bytes == 2 * mib; });
  }
};

// Host memory refused for the whole call that sends the deferred give backs:
// they stay deferred (keeping them needs no memory) and go at the next call.
TEST(lending_waiting_borrow, deferred_give_backs_stay_deferred_when_their_send_finds_no_host_memory) {
  deferred_give_backs d;
  {
    refusing_allocations refuse;
    EXPECT_THROW((void)d.b.metrics(), std::bad_alloc);
  }
  EXPECT_EQ(d.f.l->status().lent_bytes, (2 + 2 * deferred_give_backs::count) * mib) << "nothing was sent";
  (void)d.b.metrics();
  EXPECT_TRUE(d.all_given_back()) << "a deferred give back was lost: " << d.f.l->status().lent_bytes << " bytes lent";
}

// Host memory refused at each allocation in turn of the call that sends the
// give backs deferred behind a waiting borrow: each goes exactly once — at
// that call or the next — or the borrower says its link is out of step; never
// a give back dropped in silence (its region lent for as long as the
// connection lasts) or sent twice.
TEST(lending_waiting_borrow, deferred_give_backs_survive_refused_host_memory_at_each_allocation_of_their_send) {
  bool every_allocation_tried = false;
  for (int nth = 1; nth <= 200 && !every_allocation_tried; ++nth) {
    SCOPED_TRACE("the allocation refused: " + std::to_string(nth));
    deferred_give_backs d;
    {
      refusing_one_allocation refuse(nth, [] {});
      try {
        (void)d.b.metrics();
      } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): what the sweep causes
      }
      every_allocation_tried = !refuse.refused();
    }
    try {
      (void)d.b.metrics();
    } catch (const connection_closed&) {
      continue;  // out of step (an answer read in part), and said so
    }
    EXPECT_TRUE(d.all_given_back()) << "a deferred give back was lost: " << d.f.l->status().lent_bytes << " bytes lent";
    EXPECT_EQ(d.f.l->status().connections_closed_for_errors, 0u) << "a give back was sent twice";
    EXPECT_NO_THROW(d.b.give_back(d.b.borrow(2 * mib, "after"))) << "the borrower is usable";
  }
  EXPECT_TRUE(every_allocation_tried) << "more than 200 allocations: widen the sweep";
}

TEST(lending_waiting_borrow, what_a_uid_waits_for_counts_against_its_quota) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "borrowers of another uid (setresuid to 65534) need root and the uid mapped";
  const std::string name = "shoal-waiting-test-" + std::to_string(::getpid());
  constexpr uid_t nobody = 65534;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::abstract(name),
           {.capacity_bytes = 8 * mib, .quota_bytes_per_uid = 6 * mib, .policy = channel::access_policy{{nobody}, {}}});
  borrower holder(dev, l.address());
  auto held = holder.borrow(6 * mib, "held");  // 2 MiB stay free
  const auto waiter = [&] {
    return std::make_unique<child_process>(
        SHOAL_TEST_BORROWER,
        std::vector<std::string>{"wait-borrow", "host", "@" + name, std::to_string(4 * mib), "30000", "nobody"});
  };
  auto first = waiter();
  ASSERT_TRUE(eventually([&] { return l.status().waiting.size() == 1; }));
  auto second = waiter();  // 4 MiB waited for + 4 MiB more > the uid's 6 MiB
  const std::string refused = line_from(*second);
  EXPECT_EQ(refused.rfind("refused", 0), 0u) << refused;
  EXPECT_NE(refused.find("and waits for 4194304 more"), std::string::npos) << refused;
  EXPECT_EQ(l.status().waiting.size(), 1u) << "one uid filled the line past its quota";
  holder.give_back(std::move(held));
  const std::string lent = line_from(*first);
  EXPECT_EQ(lent.rfind("lent ", 0), 0u) << lent;
}

// Borrows `bytes` without a wait: "lent" (the region kept in `kept`), or the refusal's reason.
std::string borrow_at_once(borrower& b, std::size_t bytes, std::vector<borrowed_region>& kept) {
  try {
    kept.push_back(b.borrow(bytes, "at once"));
    return "lent";
  } catch (const lending::memory_refused& e) {
    return std::string(lending::to_string(e.reason()));
  }
}

// A lender of 8 MiB, 5 MiB of it held by this process (uid 0), that admits
// borrowers of uid nobody (child processes).
struct two_uids {
  static constexpr uid_t nobody = 65534;
  std::string name = "shoal-behind-test-" + std::to_string(::getpid());
  backend::device& dev = backend::host_device_instance();
  lender l{dev, channel::channel_address::abstract(name),
           {.capacity_bytes = 8 * mib, .policy = channel::access_policy{{nobody}, {}}}};
  borrower holder{dev, l.address()};
  borrowed_region held = holder.borrow(5 * mib, "held");  // 3 MiB stay free

  // A borrower of uid nobody whose borrow of `bytes` waits up to `wait`; it
  // says "lent <id>" or "refused <why>".
  std::unique_ptr<child_process> nobody_waiting(std::size_t bytes, std::chrono::milliseconds wait) {
    auto child = std::make_unique<child_process>(
        SHOAL_TEST_BORROWER, std::vector<std::string>{"wait-borrow", "host", "@" + name, std::to_string(bytes),
                                                      std::to_string(wait.count()), "nobody"});
    EXPECT_TRUE(eventually([&] { return l.status().waiting.size() == 1; }));
    return child;
  }
};

TEST(lending_waiting_borrow, a_uid_whose_wait_ran_out_waits_behind_the_other_uids_for_as_long_as_it_waited) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  two_uids f;
  borrower other(f.dev, f.l.address()), other_waiting(f.dev, f.l.address());
  std::vector<borrowed_region> kept;
  // Uid nobody asks for more than will come free; its wait runs out, and it asks again at once.
  // 3 s: it waits behind as long, past every step below.
  auto first = f.nobody_waiting(4 * mib, 3s);
  EXPECT_EQ(borrow_at_once(other, mib, kept), "others_waiting") << "during uid nobody's first wait";
  const std::string expired = line_from(*first);
  EXPECT_NE(expired.find("waited 3000 ms"), std::string::npos) << expired;
  auto again = f.nobody_waiting(4 * mib, 10s);
  EXPECT_EQ(borrow_at_once(other, mib, kept), "lent") << "uid nobody's second wait held another uid's borrow up";
  auto ahead = std::async(std::launch::async, [&] {
    return other_waiting.borrow(4 * mib, "ahead", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}});
  });
  ASSERT_TRUE(eventually([&] { return f.l.status().waiting.size() == 2; }));
  const auto line = f.l.status().waiting;
  EXPECT_EQ(line[0].uid, 0u) << "the status lists the line in the order it is served";
  EXPECT_EQ(line[1].uid, two_uids::nobody);
  f.holder.give_back(std::move(f.held));  // 7 MiB free: room for one of the two 4 MiB borrows
  ASSERT_EQ(ahead.wait_for(answer_timeout), std::future_status::ready) << "uid nobody's borrow waiting behind went first";
  auto region = ahead.get();
  EXPECT_TRUE(eventually([&] { return f.l.status().waiting.size() == 1; }));
  other_waiting.give_back(std::move(region));
  const std::string lent = line_from(*again);
  EXPECT_EQ(lent.rfind("lent ", 0), 0u) << "a borrow waiting behind is served in its turn: " << lent;
}

// Ending a wait just before it runs out (here by hanging up) and asking
// again keeps no uid ahead: a wait its borrower ends puts its uid behind too.
TEST(lending_waiting_borrow, a_uid_whose_borrower_ended_its_wait_waits_behind_the_other_uids_as_after_one_ran_out) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  two_uids f;
  borrower other(f.dev, f.l.address());
  std::vector<borrowed_region> kept;
  auto first = f.nobody_waiting(4 * mib, 10s);
  EXPECT_EQ(borrow_at_once(other, mib, kept), "others_waiting") << "during uid nobody's first wait";
  std::this_thread::sleep_for(3s);  // it waits behind as long, past every step below
  first.reset();                    // killed with its borrow waiting: its connection hangs up
  ASSERT_TRUE(eventually([&] { return f.l.status().waiting.empty(); }));
  auto again = f.nobody_waiting(4 * mib, 10s);
  EXPECT_EQ(borrow_at_once(other, mib, kept), "lent") << "uid nobody's wait after a hang-up held another uid's borrow up";
}

// A uid behind for a short while (a wait it ended at once) goes back to its
// place in line when that lapses: its wait, begun earlier, is served before a
// later wait of another uid.
TEST(lending_waiting_borrow, a_wait_begun_behind_takes_its_place_in_line_once_its_uids_stretch_behind_lapses) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  two_uids f;
  borrower other_waiting(f.dev, f.l.address());
  auto first = f.nobody_waiting(4 * mib, 10s);
  std::this_thread::sleep_for(2s);  // behind as long, past starting the next borrower process
  first.reset();                    // ended by a hang-up
  ASSERT_TRUE(eventually([&] { return f.l.status().waiting.empty(); }));
  auto again = f.nobody_waiting(4 * mib, 10s);
  std::vector<borrowed_region> kept;
  EXPECT_EQ(borrow_at_once(other_waiting, mib, kept), "lent") << "uid nobody's new wait did not begin behind";
  std::this_thread::sleep_for(2500ms);  // past the stretch behind; nothing stays free (2 MiB granules), 6 MiB
                                        // once the holder gives back
  auto later = std::async(std::launch::async, [&] {
    return other_waiting.borrow(4 * mib, "later", region_mode::exclusive, answer_timeout, borrow_wait{10s, {}});
  });
  ASSERT_TRUE(eventually([&] { return f.l.status().waiting.size() == 2; }));
  EXPECT_EQ(f.l.status().waiting[0].uid, two_uids::nobody) << "uid nobody's earlier wait stayed behind a later one";
  f.holder.give_back(std::move(f.held));  // room for one of the two 4 MiB borrows
  const std::string lent = line_from(*again);
  EXPECT_EQ(lent.rfind("lent ", 0), 0u) << "uid nobody's earlier wait was not served first: " << lent;
  EXPECT_EQ(later.wait_for(200ms), std::future_status::timeout) << "the later wait went first";
  again.reset();  // uid nobody's process goes, and its region with it: the later wait's turn
  ASSERT_EQ(later.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(later.get().valid());
}

TEST(lending_waiting_borrow, a_uid_waits_behind_the_others_no_longer_than_its_wait_lasted) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  two_uids f;
  borrower other(f.dev, f.l.address());
  std::vector<borrowed_region> kept;
  auto first = f.nobody_waiting(4 * mib, 300ms);
  const std::string expired = line_from(*first);
  EXPECT_EQ(expired.rfind("refused", 0), 0u) << expired;
  std::this_thread::sleep_for(500ms);  // past the 300 ms it waited
  auto again = f.nobody_waiting(4 * mib, 10s);
  EXPECT_EQ(borrow_at_once(other, mib, kept), "others_waiting") << "uid nobody still waits behind the others";
}

// A head refused at its turn for its uid's quota puts its uid behind the
// other uids, as a wait that ran out does. Its way there: the head passed
// uid 0's quota only by a mapping its sibling keeps (dropped as the head's
// memory is lent), then the sibling waits for that very memory — a hold
// that adds nothing to the uid's count passes at once — and at the head's
// turn the sibling's wait counts too, past what dropping could make room for.
TEST(lending_waiting_borrow, a_head_refused_for_its_uids_quota_at_its_turn_puts_its_uid_behind_the_other_uids) {
  if (!may_act_as({65534, 65533}))
    GTEST_SKIP() << "borrowers of other uids (setresuid to 65534 and 65533) need root and the uid mapped";
  const std::string name = "shoal-head-quota-test-" + std::to_string(::getpid());
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::abstract(name),
           {.capacity_bytes = 6 * mib,
            .quota_bytes_per_uid = 4 * mib,
            .policy = channel::access_policy{{two_uids::nobody, 65533}, {}}});
  // A borrower process of `uid` whose borrow of `bytes` waits up to `wait`; it says "lent <id>" or "refused <why>".
  const auto borrower_of = [&](const std::string& uid, std::size_t bytes, std::chrono::milliseconds wait) {
    return std::make_unique<child_process>(
        SHOAL_TEST_BORROWER, std::vector<std::string>{"wait-borrow", "host", "@" + name, std::to_string(bytes),
                                                      std::to_string(wait.count()), uid});
  };
  const auto in_line = [&](std::size_t count) {
    return eventually([&] { return l.status().waiting.size() == count; });
  };
  const auto borrow_waiting = [&](borrower& b, std::size_t bytes, const char* purpose) {
    return std::async(std::launch::async, [&b, bytes, purpose] {
      return b.borrow(bytes, purpose, region_mode::exclusive, answer_timeout, borrow_wait{10s, {}});
    });
  };
  borrower sibling(dev, l.address()), head(dev, l.address());
  sibling.give_back(sibling.borrow(2 * mib, "kept"));
  ASSERT_EQ(l.status().spares.at(0).kept_by, 1u) << "the sibling keeps 2 MiB of uid 0's 4 mapped";
  auto holder = borrower_of("nobody", 4 * mib, 0ms);  // the rest of the capacity
  ASSERT_EQ(line_from(*holder).rfind("lent ", 0), 0u);
  auto first = borrow_waiting(head, 4 * mib, "head");  // within the quota once the kept mapping goes
  ASSERT_TRUE(in_line(1));
  auto reused = borrow_waiting(sibling, 2 * mib, "what it keeps mapped");
  ASSERT_TRUE(in_line(2));
  std::this_thread::sleep_for(2s);  // the head holds the line as long: uid 0 waits behind as long, past the steps below
  holder.reset();                   // its memory comes back: the head's turn
  try {
    (void)first.get();
    ADD_FAILURE() << "lent past uid 0's quota";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("per-uid quota"), std::string::npos) << e.what();
  }
  ASSERT_EQ(reused.wait_for(answer_timeout), std::future_status::ready);
  auto kept = reused.get();
  auto holder_again = borrower_of("nobody", 4 * mib, 0ms);  // the capacity taken again
  ASSERT_EQ(line_from(*holder_again).rfind("lent ", 0), 0u);
  auto later = borrow_waiting(head, 2 * mib, "later");  // uid 0 first, then uid 65533
  ASSERT_TRUE(in_line(1));
  auto other = borrower_of("65533", 2 * mib, 5s);
  ASSERT_TRUE(in_line(2));
  EXPECT_EQ(l.status().waiting[0].uid, 65533u) << "uid 0's head refused at its turn left its uid ahead of the others";
  sibling.give_back(std::move(kept));  // room for one of the two 2 MiB borrows
  const std::string lent = line_from(*other);
  EXPECT_EQ(lent.rfind("lent ", 0), 0u) << "uid 65533's later wait was not served first: " << lent;
  EXPECT_EQ(later.wait_for(200ms), std::future_status::timeout) << "uid 0's wait went first";
  holder_again.reset();  // room for uid 0's wait in its turn
  ASSERT_EQ(later.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(later.get().valid());
}

TEST(lending_waiting_borrow, within_one_uid_the_line_stays_in_order_after_a_wait_runs_out) {
  waiting_fixture f(8 * mib);  // every borrower of one uid, as most deployments run
  borrower holder(f.dev, f.l->address()), model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address()),
      model_c(f.dev, f.l->address());
  auto held = holder.borrow(5 * mib, "held");  // 3 MiB stay free
  EXPECT_THROW((void)model_a.borrow(4 * mib, "model A", region_mode::exclusive, answer_timeout, borrow_wait{300ms, {}}),
               out_of_memory);
  auto a = f.borrow_waiting(model_a, 4 * mib, "model A again", 10s);
  ASSERT_TRUE(f.waiting(1));
  std::vector<borrowed_region> kept;
  EXPECT_EQ(borrow_at_once(model_b, mib, kept), "others_waiting");
  auto c = f.borrow_waiting(model_c, 2 * mib, "model C", 10s);
  ASSERT_TRUE(f.waiting(2));
  EXPECT_EQ(c.wait_for(200ms), std::future_status::timeout) << "model C fits the free 3 MiB but went ahead of model A";
  holder.give_back(std::move(held));
  ASSERT_EQ(a.wait_for(answer_timeout), std::future_status::ready);
  ASSERT_EQ(c.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(a.get().valid());
  EXPECT_TRUE(c.get().valid());
}

TEST(lending_waiting_borrow, the_borrowers_other_calls_give_up_at_their_timeout_and_revokes_still_reach_it) {
  waiting_fixture f(8 * mib);
  borrower holder(f.dev, f.l->address()), b(f.dev, f.l->address()), operator_(f.dev, f.l->address());
  auto held = holder.borrow(4 * mib, "held");
  auto own = b.borrow(2 * mib, "own");
  auto more = std::async(std::launch::async, [&] { return b.borrow(4 * mib, "more", {.for_memory = 10s}); });
  ASSERT_TRUE(f.waiting(1));
  auto start = std::chrono::steady_clock::now();
  try {
    (void)b.metrics(300ms);
    ADD_FAILURE() << "answered through a connection a waiting borrow holds";
  } catch (const timeout_error& e) {
    EXPECT_NE(std::string(e.what()).find("another call holds the connection"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms) << "a call waited past its timeout";
  operator_.revoke(own.id(), 5s);
  start = std::chrono::steady_clock::now();
  const auto asked = b.revocations(5s);  // the waiting borrow read the revoke
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].region, own.id());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s) << "the revoke waited for the borrow's wait to end";
  holder.give_back(std::move(held));
  ASSERT_EQ(more.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(more.get().valid());
}

// A raw connection that said hello.
channel::connection greeted(const channel::channel_address& address) {
  auto raw = channel::connection::connect(address, {}, lending::detail::max_frame_payload, 2000ms);
  channel::send_hello(raw, lending::detail::lending_protocol);
  channel::check_hello(raw.receive_for(2000ms), lending::detail::lending_protocol);
  return raw;
}

void send_borrow(channel::connection& raw, std::uint64_t request, std::size_t bytes, std::uint32_t wait_ms) {
  raw.send(static_cast<std::uint16_t>(message_type::borrow),
           lending::detail::encode(
               lending::detail::borrow_message{request, bytes, region_mode::exclusive, "raw", wait_ms}));
}

// A raw connection whose borrow of the whole capacity (8 MiB), request 1,
// waits in line behind `holder`'s region.
channel::connection raw_waiting(waiting_fixture& f) {
  auto raw = greeted(f.l->address());
  send_borrow(raw, 1, 8 * mib, 60'000);
  EXPECT_TRUE(f.waiting(1));
  return raw;
}

TEST(lending_waiting_borrow, a_borrower_that_hangs_up_while_it_waits_leaves_the_line) {
  waiting_fixture f(8 * mib);
  borrower holder(f.dev, f.l->address()), next(f.dev, f.l->address());
  auto held = holder.borrow(8 * mib, "held");
  std::optional<std::future<borrowed_region>> after;
  {
    auto raw = raw_waiting(f);
    after = f.borrow_waiting(next, 8 * mib, "next", 10s);
    ASSERT_TRUE(f.waiting(2));
  }  // the raw borrower hangs up at the head of the line
  EXPECT_TRUE(f.waiting(1)) << "a borrower gone keeps its place";
  EXPECT_EQ(f.l->status().waiting.at(0).purpose, "next");
  holder.give_back(std::move(held));
  ASSERT_EQ(after->wait_for(answer_timeout), std::future_status::ready) << "the line stopped at the borrower gone";
  EXPECT_TRUE(after->get().valid());
}

// The refusal of a waiting borrow that stopped waiting, which a raw
// connection reads for request `request`: its text.
std::string stopped_waiting_refusal(channel::connection& raw, std::uint64_t request) {
  const channel::frame f = raw.receive_for(2000ms);
  EXPECT_EQ(f.type, static_cast<std::uint16_t>(message_type::refused));
  if (f.type != static_cast<std::uint16_t>(message_type::refused)) return {};
  const auto refused = lending::detail::decode_refused(f.payload);
  EXPECT_EQ(refused.request, request);
  EXPECT_EQ(refused.reason, lending::detail::refusal::stopped_waiting);
  return refused.why;
}

TEST(lending_waiting_borrow, a_request_behind_a_waiting_borrow_ends_its_wait_and_answers_stay_in_order) {
  waiting_fixture f(8 * mib);
  borrower holder(f.dev, f.l->address());
  auto held = holder.borrow(8 * mib, "held");
  auto raw = raw_waiting(f);
  raw.send(static_cast<std::uint16_t>(message_type::query_metrics), std::span<const std::byte>{});
  const std::string why = stopped_waiting_refusal(raw, 1);
  EXPECT_NE(why.find("another request behind it"), std::string::npos) << why;
  EXPECT_EQ(raw.receive_for(2000ms).type, static_cast<std::uint16_t>(message_type::metrics));
  EXPECT_TRUE(f.l->status().waiting.empty());
}

TEST(lending_waiting_borrow, a_cancel_ends_the_wait_at_once_and_one_for_an_answered_borrow_is_dropped) {
  waiting_fixture f(8 * mib);
  borrower holder(f.dev, f.l->address());
  auto held = holder.borrow(8 * mib, "held");
  auto raw = raw_waiting(f);
  raw.send(static_cast<std::uint16_t>(message_type::cancel_wait), lending::detail::encode_cancel_wait(1));
  const std::string why = stopped_waiting_refusal(raw, 1);
  EXPECT_NE(why.find("its borrower stopped waiting"), std::string::npos) << why;
  EXPECT_TRUE(f.l->status().waiting.empty());
  // A cancel that crossed its borrow's answer (request 1 is answered) has no answer of its own.
  raw.send(static_cast<std::uint16_t>(message_type::cancel_wait), lending::detail::encode_cancel_wait(1));
  raw.send(static_cast<std::uint16_t>(message_type::query_metrics), std::span<const std::byte>{});
  EXPECT_EQ(raw.receive_for(2000ms).type, static_cast<std::uint16_t>(message_type::metrics));
}

struct stop_waiting : std::runtime_error {
  stop_waiting() : std::runtime_error("stop waiting") {}
};

TEST(lending_waiting_borrow, an_interrupt_check_ends_the_wait_and_the_borrower_leaves_the_line) {
  waiting_fixture f(8 * mib);
  borrower model_a(f.dev, f.l->address()), model_b(f.dev, f.l->address()), model_c(f.dev, f.l->address());
  auto a = model_a.borrow(8 * mib, "model A");
  std::atomic<int> checks{0};
  auto start = std::chrono::steady_clock::now();
  const borrow_wait wait{30s, [&] {
                           if (++checks == 3) throw stop_waiting();
                         }};
  EXPECT_THROW((void)model_b.borrow(8 * mib, "model B", region_mode::exclusive, answer_timeout, wait), stop_waiting);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s) << "the check was not called while the borrow waited";
  EXPECT_EQ(checks.load(), 3);
  EXPECT_TRUE(f.waiting(0)) << "model B stopped waiting but kept its place in line";
  start = std::chrono::steady_clock::now();
  (void)model_b.metrics();  // reads the refusal its cancel brought first
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s) << "the next call waited behind the abandoned borrow";
  auto c = f.borrow_waiting(model_c, 8 * mib, "model C", 10s);
  ASSERT_TRUE(f.waiting(1));
  model_a.give_back(std::move(a));
  ASSERT_EQ(c.wait_for(answer_timeout), std::future_status::ready);
  EXPECT_TRUE(c.get().valid()) << "the memory went to the borrow that still waited";
}

// Across processes on each backend (CUDA imports only in another process):
// the waiting borrower is a process, the memory comes back when the holder
// process is killed.
template <class Backend>
class waiting_borrow_processes : public lending_test<Backend> {};
TYPED_TEST_SUITE(waiting_borrow_processes, backend_types, backend_names);

TYPED_TEST(waiting_borrow_processes, a_waiting_process_is_lent_the_memory_of_one_killed) {
  auto& l = this->start({.capacity_bytes = 4 * mib});
  auto holder = this->borrower_process({"hold", std::to_string(4 * mib), "90"});
  ASSERT_EQ(line_from(*holder).rfind("held ", 0), 0u);
  auto waiter = this->borrower_process({"wait-borrow", std::to_string(4 * mib), "30000"});
  ASSERT_TRUE(eventually([&] { return l.status().waiting.size() == 1; }));
  ASSERT_EQ(::kill(holder->pid(), SIGKILL), 0);
  EXPECT_EQ(holder->wait(), 128 + SIGKILL);
  const std::string lent = line_from(*waiter);
  EXPECT_EQ(lent.rfind("lent ", 0), 0u) << lent;
  EXPECT_EQ(l.status().waits, 1u);
  EXPECT_EQ(l.status().lent_bytes, 4 * mib);
}

// A forked worker of a borrower whose other thread waits for memory at the
// lender (it holds the borrower's connection): the worker drops a region it
// inherited (its give back is deferred after drop_timeout), then the borrower.
TEST(lending_waiting_borrow, a_forked_child_drops_an_inherited_region_and_borrower_while_a_parent_borrow_waits) {
  waiting_fixture f(16 * mib);
  borrower model_a(f.dev, f.l->address());
  auto other = std::make_unique<borrower>(f.dev, f.l->address());
  std::optional<lending::borrowed_region> a = other->borrow(4 * mib, "held");
  auto filler = model_a.borrow(12 * mib, "filler");
  auto waiting = f.borrow_waiting(*other, 8 * mib, "waits", 20s);  // holds other's connection
  ASSERT_TRUE(f.waiting(1));

  forked_child child([&] {
    a.reset();      // give back: the connection is taken, deferred after 1 s
    other.reset();  // the link's end settles what was deferred
    return 0;
  });
  const std::optional<int> status = child.wait_for(8s);
  model_a.give_back(std::move(filler));
  a.reset();
  (void)waiting.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung dropping the borrower (a lock its parent's thread held)";
  EXPECT_EQ(*status, 0);
}

}  // namespace
}  // namespace shoal::testing
