// A borrow whose answer comes after its deadline (a lender busy with another
// borrower's publish, or stopped for a while): the borrower keeps the link in
// step and gives the late region back unmapped — at its next call, in
// revocations(), or as the connection closes — so the lender does not keep
// it lent until this process ends; and a region the borrower cannot map is
// given back at once (host backend, in one process).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>
#include <string>
#include <thread>

#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "shoal/backend/host_device.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/lending/layout.h"
#include "support/forwarding_device.h"

namespace shoal::testing {
namespace {

using lending::detail::message_type;

// A lender whose serving thread stalls in publishes until the test lets
// each go: a request sent meanwhile is answered only then. Each stall is
// the publish of one of its writers (connect borrowers before a stall:
// their hellos wait too).
struct stalled_lender {
  temp_dir dir;
  backend::device& dev = backend::host_device_instance();
  lender l{dev, channel::channel_address::at_path(dir / "l.sock")};
  std::vector<std::unique_ptr<borrower>> writers;
  std::mutex mutex;
  std::condition_variable changed;
  int stalls = 0;    // publishes that reached the hook
  int released = 0;  // of them, let go
  std::optional<publish_hook> hook;
  std::vector<std::future<void>> publishing;
  std::vector<lending::borrowed_region> published;  // under mutex: held, so the lender keeps them

  stalled_lender() {
    for (int i = 0; i < 3; ++i) writers.push_back(std::make_unique<borrower>(dev, l.address()));
    hook.emplace([this](std::uint64_t) {
      std::unique_lock lock(mutex);
      const int mine = ++stalls;
      changed.notify_all();
      changed.wait(lock, [&] { return released >= mine; });
    });
  }
  ~stalled_lender() {  // a test that failed while the lender stalled must not hang here
    {
      std::lock_guard lock(mutex);
      released = 1 << 20;
      changed.notify_all();
    }
    for (auto& p : publishing) p.wait();
  }
  stalled_lender(const stalled_lender&) = delete;
  stalled_lender& operator=(const stalled_lender&) = delete;

  // Returns once the serving thread stalls in the publish of a fresh
  // region of the next writer.
  void stall() {
    borrower& writer = *writers.at(publishing.size());
    auto region = writer.borrow(2 * mib, "weights " + std::to_string(publishing.size()));
    lending::region_layout layout;
    layout.entries = {{"w", 0, region.size(), lending::dtype::uint8, {region.size()}}};
    layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
    std::unique_lock lock(mutex);
    const int before = stalls;
    publishing.push_back(std::async(std::launch::async, [this, &writer, r = std::move(region), layout]() mutable {
      auto shared = writer.publish(std::move(r), layout, 20s);
      std::lock_guard done(mutex);
      published.push_back(std::move(shared));
    }));
    changed.wait(lock, [&] { return stalls > before; });
  }
  // Lets the oldest stall go.
  void release() {
    std::lock_guard lock(mutex);
    ++released;
    changed.notify_all();
  }
  // Regions lent or orphaned but the writers'.
  std::size_t others() { return l.status().regions.size() - publishing.size(); }

  // Stalls the lender and lets a borrow of `b` time out meanwhile.
  void borrow_times_out(borrower& b) {
    stall();
    EXPECT_THROW((void)b.borrow(4 * mib, "late", lending::region_mode::exclusive, 100ms), timeout_error);
  }
  // borrow_times_out, then lets the lender go: it lends that region late,
  // to a borrower that no longer waits for it.
  void lend_late(borrower& b) {
    borrow_times_out(b);
    release();
    EXPECT_TRUE(eventually([&] { return others() == 1; })) << "the lender did not lend the late borrow";
  }
};

TEST(lending_late_answers, a_region_lent_after_the_borrow_timed_out_is_given_back_at_the_next_call) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.lend_late(b);
  // The next call reads the late answer first and gives that region back.
  const std::string text = b.metrics();
  EXPECT_NE(text.find("shoal_lending_capacity_bytes"), std::string::npos);
  EXPECT_EQ(s.others(), 0u) << "the late region stays lent";
  auto region = b.borrow(4 * mib, "on time");
  EXPECT_EQ(s.others(), 1u);
  b.give_back(std::move(region));
  EXPECT_EQ(s.others(), 0u);
}

TEST(lending_late_answers, a_late_region_is_given_back_when_the_connection_closes) {
  stalled_lender s;
  {
    borrower b(s.dev, s.l.address());
    s.borrow_times_out(b);
    s.release();
  }  // closes: the late answer is read and its region given back first
  EXPECT_EQ(s.others(), 0u) << "the region of the late answer stays with the lender as lent or orphaned";
}

TEST(lending_late_answers, revocations_takes_a_late_answer_and_gives_its_region_back) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.lend_late(b);
  EXPECT_TRUE(b.revocations(200ms).empty());
  EXPECT_EQ(s.others(), 0u);
  EXPECT_NO_THROW((void)b.metrics());
}

TEST(lending_late_answers, a_call_made_before_the_late_answer_came_times_out_and_the_link_stays_in_step) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.borrow_times_out(b);
  EXPECT_THROW((void)b.metrics(100ms), timeout_error) << "the lender is still stalled";
  s.release();
  EXPECT_NO_THROW((void)b.metrics());
  EXPECT_EQ(s.others(), 0u);
}

// The lender is slow again when the late answer comes: revocations() takes
// it without waiting for its give back's answer, which is owed in turn.
TEST(lending_late_answers, revocations_keeps_its_deadline_when_the_lender_is_slow_again) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.lend_late(b);
  s.stall();  // busy again, in another writer's publish
  const auto started = std::chrono::steady_clock::now();
  EXPECT_TRUE(b.revocations(0ms).empty());
  EXPECT_LT(std::chrono::steady_clock::now() - started, 200ms) << "revocations(0) waited for the lender";
  s.release();
  EXPECT_NO_THROW((void)b.metrics()) << "the link did not stay in step";
  EXPECT_EQ(s.others(), 0u);
}

// The call after the late answer has a short deadline and the lender is
// slow again: that call times out, and the link stays in step for the next.
TEST(lending_late_answers, a_short_call_while_the_lender_is_slow_again_leaves_the_link_in_step) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.lend_late(b);
  s.stall();
  EXPECT_THROW((void)b.borrow(4 * mib, "next", lending::region_mode::exclusive, 100ms), timeout_error);
  s.release();
  EXPECT_NO_THROW((void)b.metrics(2s));
  EXPECT_EQ(s.others(), 0u) << "a region lent late stayed lent";
}

// A give back whose answer does not come in time has still gone: the lender
// does not keep the region lent to a borrower that unmapped it.
TEST(lending_late_answers, a_give_back_that_times_out_is_sent_all_the_same) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  auto region = b.borrow(4 * mib, "held");
  const auto id = region.id();
  s.borrow_times_out(b);
  EXPECT_THROW(b.give_back(std::move(region), 100ms), timeout_error);
  s.release();
  EXPECT_NO_THROW((void)b.metrics());
  EXPECT_EQ(s.others(), 0u) << "region " << id << " (given back) or the late one is still lent";
  EXPECT_THROW(s.l.revoke(id, 1s), invalid_argument) << "the lender still counts the region given back as lent";
}

// Answers owed are bounded: past 64 (give backs that timed out one after
// another while the lender stalled), the borrower gives the link up rather
// than remember without end — its next call says so (connection_closed).
TEST(lending_late_answers, past_64_answers_owed_the_link_is_given_up) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  std::vector<lending::borrowed_region> regions;
  for (int i = 0; i < 65; ++i) regions.push_back(b.borrow(2 * mib, "one of many"));
  s.stall();
  for (auto& region : regions) EXPECT_THROW(b.give_back(std::move(region), 5ms), timeout_error);
  s.release();
  EXPECT_THROW((void)b.metrics(), connection_closed) << "65 answers owed and the link kept";
}

// Dropping the last region while the lender is slow: the give back is sent
// and owed; the connection's end waits for the owed answers once, not twice.
TEST(lending_late_answers, dropping_the_last_region_while_the_lender_is_slow_waits_at_most_a_second) {
  stalled_lender s;
  std::optional<lending::borrowed_region> region;
  {
    borrower b(s.dev, s.l.address());
    region.emplace(b.borrow(4 * mib, "held"));
    s.borrow_times_out(b);
  }
  const auto started = std::chrono::steady_clock::now();
  region.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 1500ms);
  s.release();
}

// The late region is memory this borrower keeps mapped (lent with no
// chunks): its mapping goes back to being kept, not unmapped.
TEST(lending_late_answers, a_late_region_on_a_kept_mapping_leaves_the_mapping_kept) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  b.give_back(b.borrow(4 * mib, "first"));
  ASSERT_EQ(b.kept().count, 1u);
  s.borrow_times_out(b);
  s.release();
  EXPECT_NO_THROW((void)b.metrics());
  EXPECT_EQ(s.others(), 0u);
  EXPECT_EQ(b.kept().count, 1u) << "the kept mapping was dropped";
  auto again = b.borrow(4 * mib, "again");
  EXPECT_EQ(b.kept().count, 0u) << "lent again on the kept mapping";
}

// A device whose imports fail while `refuse` is set.
class refusing_imports : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  using forwarding_device::import_memory;
  void* import_memory(std::span<const backend::shareable_handle> chunks, backend::memory_access access) override {
    if (refuse) throw backend_error("import_memory", "refused by the test");
    return forwarding_device::import_memory(chunks, access);
  }
  std::atomic<bool> refuse{true};
};

// A region lent that this borrower cannot map is given back at once, and
// the link stays in step for the next borrow.
TEST(lending_late_answers, a_region_the_borrower_cannot_map_is_given_back_at_once) {
  temp_dir dir;
  auto& host = backend::host_device_instance();
  lender l(host, channel::channel_address::at_path(dir / "l.sock"));
  refusing_imports dev(host);
  borrower b(dev, l.address());
  EXPECT_THROW((void)b.borrow(2 * mib, "unmappable"), backend_error);
  EXPECT_TRUE(eventually([&] { return l.status().regions.empty(); })) << "the unmapped region stays lent";
  dev.refuse = false;
  EXPECT_TRUE(b.borrow(2 * mib, "mappable").valid());
}

// A lender whose answer after a timeout names another request broke the
// protocol: the link is closed, nothing more is asked.
TEST(lending_late_answers, a_late_answer_to_another_request_closes_the_link) {
  temp_dir dir;
  const auto address = channel::channel_address::at_path(dir / "liar.sock");
  channel::listener liar(address, {});
  std::promise<void> timed_out;
  auto server = std::async(std::launch::async, [&] {
    auto link = liar.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    (void)link.receive_for(5s);  // the hello
    (void)link.receive_for(5s);  // borrow 1
    timed_out.get_future().wait();
    link.send(static_cast<std::uint16_t>(message_type::lent),
              lending::detail::encode(lending::detail::lent_message{7, 5, 3, 4096, 1}));  // request 7: never asked
    try {
      (void)link.receive_for(2s);  // a request would come here
      return true;
    } catch (const error&) {
      return false;
    }
  });
  {
    borrower b(backend::host_device_instance(), address);
    EXPECT_THROW((void)b.borrow(4096, "one", lending::region_mode::exclusive, 100ms), timeout_error);
    timed_out.set_value();
    EXPECT_THROW((void)b.metrics(), protocol_error);
    EXPECT_THROW((void)b.metrics(), connection_closed);
  }
  EXPECT_FALSE(server.get()) << "the borrower asked again on a link whose lender broke the protocol";
}

}  // namespace
}  // namespace shoal::testing
