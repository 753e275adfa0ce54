// A borrow whose answer comes after its deadline (a lender busy with another
// borrower's publish, or stopped for a while): the borrower keeps the link in
// step and gives the late region back unmapped — at its next call, in
// revocations(), or as the connection closes — so the lender does not keep
// it lent until this process ends (host backend, in one process).
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "shoal/backend/host_device.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/lending/layout.h"

namespace shoal::testing {
namespace {

using lending::detail::message_type;

// A lender whose serving thread stalls in a publish until the test lets it
// go: a borrow sent meanwhile is answered only then (connect borrowers
// before it stalls: their hellos wait too).
struct stalled_lender {
  temp_dir dir;
  backend::device& dev = backend::host_device_instance();
  lender l{dev, channel::channel_address::at_path(dir / "l.sock")};
  borrower writer{dev, l.address()};
  std::promise<void> stalled;
  std::promise<void> go_on;
  std::shared_future<void> released = go_on.get_future().share();
  std::optional<publish_hook> hook;
  std::future<void> publishing;
  lending::borrowed_region published;  // held: the one region the lender keeps besides the test's

  void stall() {
    auto region = writer.borrow(2 * mib, "weights");
    lending::region_layout layout;
    layout.entries = {{"w", 0, region.size(), lending::dtype::uint8, {region.size()}}};
    layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
    hook.emplace([this](std::uint64_t) {
      stalled.set_value();
      released.wait();
    });
    publishing = std::async(std::launch::async, [this, r = std::move(region), layout]() mutable {
      published = writer.publish(std::move(r), layout);
    });
    stalled.get_future().wait();
  }
  void release() {
    go_on.set_value();
    publishing.get();
  }
  ~stalled_lender() {  // a test that failed while it stalled must not hang here
    if (!publishing.valid()) return;
    try {
      go_on.set_value();
    } catch (const std::future_error&) {  // NOLINT(bugprone-empty-catch): released already
    }
    publishing.wait();
  }
  stalled_lender() = default;
  stalled_lender(const stalled_lender&) = delete;
  stalled_lender& operator=(const stalled_lender&) = delete;
  // Regions lent or orphaned but the writer's published one.
  std::size_t others() { return l.status().regions.size() - 1; }
};

TEST(lending_late_answers, a_region_lent_after_the_borrow_timed_out_is_given_back_at_the_next_call) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.stall();
  EXPECT_THROW((void)b.borrow(4 * mib, "late", lending::region_mode::exclusive, 100ms), timeout_error);
  s.release();
  ASSERT_TRUE(eventually([&] { return s.others() == 1; })) << "the lender lent the late borrow";
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
    s.stall();
    EXPECT_THROW((void)b.borrow(4 * mib, "late", lending::region_mode::exclusive, 100ms), timeout_error);
    s.release();
  }  // closes: the late answer is read and its region given back first
  EXPECT_EQ(s.others(), 0u) << "the region of the late answer stays with the lender as lent or orphaned";
}

TEST(lending_late_answers, revocations_takes_a_late_answer_and_gives_its_region_back) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.stall();
  EXPECT_THROW((void)b.borrow(4 * mib, "late", lending::region_mode::exclusive, 100ms), timeout_error);
  s.release();
  ASSERT_TRUE(eventually([&] { return s.others() == 1; }));
  EXPECT_TRUE(b.revocations(200ms).empty());
  EXPECT_EQ(s.others(), 0u);
  EXPECT_NO_THROW((void)b.metrics());
}

TEST(lending_late_answers, a_call_made_before_the_late_answer_came_times_out_and_the_link_stays_in_step) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  s.stall();
  EXPECT_THROW((void)b.borrow(4 * mib, "late", lending::region_mode::exclusive, 100ms), timeout_error);
  EXPECT_THROW((void)b.metrics(100ms), timeout_error) << "the lender is still stalled";
  s.release();
  EXPECT_NO_THROW((void)b.metrics());
  EXPECT_EQ(s.others(), 0u);
}

// The late region is memory this borrower keeps mapped (lent with no
// chunks): its mapping goes back to being kept, not unmapped.
TEST(lending_late_answers, a_late_region_on_a_kept_mapping_leaves_the_mapping_kept) {
  stalled_lender s;
  borrower b(s.dev, s.l.address());
  b.give_back(b.borrow(4 * mib, "first"));
  ASSERT_EQ(b.kept().count, 1u);
  s.stall();
  EXPECT_THROW((void)b.borrow(4 * mib, "late", lending::region_mode::exclusive, 100ms), timeout_error);
  s.release();
  EXPECT_NO_THROW((void)b.metrics());
  EXPECT_EQ(s.others(), 0u);
  EXPECT_EQ(b.kept().count, 1u) << "the kept mapping was dropped";
  auto again = b.borrow(4 * mib, "again");
  EXPECT_EQ(b.kept().count, 0u) << "lent again on the kept mapping";
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
