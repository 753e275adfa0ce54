// The context-wide counts of sharing (max_mapped_bytes, max_producer_resources):
// reservations within the limit, given back at scope exit unless kept, and a
// give-back of more than was reserved caught where the build checks invariants.
#include "ipc/context_holdings.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <limits>
#include <optional>

#include "support/processes.h"

namespace shoal::ipc::detail {
namespace {

using namespace std::chrono_literals;

TEST(context_holdings, a_reservation_fits_up_to_the_limit_and_not_past_it_without_overflow) {
  std::atomic<std::size_t> count{0};
  EXPECT_TRUE(reserve(count, 3, 4));
  EXPECT_TRUE(reserve(count, 1, 4));
  EXPECT_FALSE(reserve(count, 1, 4));
  EXPECT_EQ(count.load(), 4u);
  EXPECT_FALSE(reserve(count, std::numeric_limits<std::size_t>::max(), std::numeric_limits<std::size_t>::max()));
  EXPECT_EQ(count.load(), 4u);
}

TEST(context_holdings, a_reservation_not_kept_is_given_back_at_scope_exit) {
  std::atomic<std::size_t> count{0};
  ASSERT_TRUE(reserve(count, 2, 10));
  { reservation dropped(count, 2); }
  EXPECT_EQ(count.load(), 0u);
  ASSERT_TRUE(reserve(count, 2, 10));
  {
    reservation kept(count, 2);
    kept.keep();
  }
  EXPECT_EQ(count.load(), 2u);
}

// A bug in the counting (a share given back twice) would otherwise wrap the
// count and leave the context refusing every share: a checking build ends
// the process at once, naming it.
TEST(context_holdings, giving_back_more_than_was_reserved_ends_a_checking_build) {
  if (!holdings_checked()) GTEST_SKIP() << "this build does not check invariants (Release)";
  testing::forked_child child([] {
    std::atomic<std::size_t> count{0};
    if (!reserve(count, 1, 10)) return 2;
    give_back(count, 1);
    give_back(count, 1);
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung";
  EXPECT_EQ(*status, 128 + SIGABRT);
}

}  // namespace
}  // namespace shoal::ipc::detail
