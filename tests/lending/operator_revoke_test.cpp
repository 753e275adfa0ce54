// borrower::revoke: the lender's operator (a process of the lender's own
// uid: `shoal daemon revoke`) revokes another borrower's region over the
// socket, so one model's memory goes to the next model's turn without the
// lender's process doing it; a process of any other uid is refused (host
// backend).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "lending/lending_fixture.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "shoal/lending/layout.h"
#include "support/other_uids.h"

namespace shoal::testing {
namespace {

TEST(lending_operator_revoke, the_operator_takes_one_borrowers_region_for_anothers_turn) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"), {.capacity_bytes = 8 * mib});
  borrower model_a(dev, l.address()), model_b(dev, l.address()), operator_(dev, l.address());
  auto a = model_a.borrow(8 * mib, "model A");
  EXPECT_THROW((void)model_b.borrow(8 * mib, "model B"), out_of_memory) << "the capacity is model A's";

  operator_.revoke(a.id(), std::chrono::seconds(5));
  const auto asked = model_a.revocations(std::chrono::seconds(5));
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].region, a.id());
  EXPECT_GT(asked[0].deadline, std::chrono::steady_clock::now() + std::chrono::seconds(3));
  model_a.give_back(std::move(a));
  EXPECT_TRUE(model_b.borrow(8 * mib, "model B").valid()) << "model B's turn";
  EXPECT_EQ(l.status().revocations, 1u);
}

TEST(lending_operator_revoke, a_region_that_cannot_be_revoked_is_a_bad_request_and_the_link_goes_on) {
  temp_dir dir;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::at_path(dir / "l.sock"));
  borrower writer(dev, l.address()), operator_(dev, l.address());
  try {
    operator_.revoke(12345, std::chrono::seconds(1));
    ADD_FAILURE() << "a region that does not exist was revoked";
  } catch (const invalid_argument& e) {
    // In the lender's words, naming none of its functions: the borrower called none.
    EXPECT_STREQ(e.what(), "the lender refused: region 12345 is not lent to a connected borrower");
  }
  auto region = writer.borrow(2 * mib, "weights");
  lending::region_layout layout;
  layout.entries = {{"w", 0, region.size(), lending::dtype::uint8, {region.size()}}};
  layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  region = writer.publish(std::move(region), layout);
  try {
    operator_.revoke(region.id(), std::chrono::seconds(1));
    ADD_FAILURE() << "a shared region was revoked";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is shared"), std::string::npos) << e.what();
  }
  EXPECT_THROW(operator_.revoke(region.id(), std::chrono::milliseconds(0)), invalid_argument) << "a 0 ms deadline";
  EXPECT_NO_THROW((void)operator_.metrics()) << "the link stays in step after the refusals";
}

TEST(lending_operator_revoke, a_borrower_of_another_uid_may_not_revoke) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "making a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  const std::string name = "shoal-revoke-test-" + std::to_string(::getpid());
  constexpr uid_t nobody = 65534;
  auto& dev = backend::host_device_instance();
  lender l(dev, channel::channel_address::abstract(name), {.policy = channel::access_policy{{nobody}, {}}});
  borrower holder(dev, l.address());
  auto region = holder.borrow(2 * mib, "held");
  const auto ask_as = [&](const char* as) {
    child_process child(SHOAL_TEST_BORROWER, std::vector<std::string>{"revoke", "host", "@" + name,
                                                                        std::to_string(region.id()), as});
    return line_from(child);
  };
  const std::string refused = ask_as("nobody");
  EXPECT_EQ(refused.rfind("refused", 0), 0u) << refused;
  EXPECT_NE(refused.find("lender's own uid (0)"), std::string::npos) << refused;
  EXPECT_TRUE(holder.revocations(std::chrono::milliseconds(100)).empty()) << "uid 65534 revoked uid 0's region";
  EXPECT_EQ(ask_as("self"), "revoked");
  EXPECT_EQ(holder.revocations(std::chrono::seconds(5)).size(), 1u);
}

}  // namespace
}  // namespace shoal::testing
