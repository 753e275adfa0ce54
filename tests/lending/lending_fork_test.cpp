// A lender and a revocation watcher in a fork() child of the process that
// made them: their threads stayed with the parent, so destroying them there
// (a Python child exiting does) returns without joining them (glibc would
// let the join return; under ThreadSanitizer it waits forever), and the
// parent's lender serves on.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <thread>

#include "lending/lending_fixture.h"
#include "shoal/backend/host_device.h"
#include "shoal/lending/revocation_watcher.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

TEST(lending_fork, a_forked_child_can_destroy_the_parents_lender_and_revocation_watcher) {
  temp_dir dir;
  backend::device& dev = backend::host_device_instance();
  auto server = std::make_unique<lender>(dev, channel::channel_address::at_path(dir / "l.sock"), lender_config{});
  borrower model(dev, server->address());
  auto held = model.borrow(2 * mib, "parameters");
  auto watcher = std::make_unique<lending::revocation_watcher>(model, [](const borrower::revocation&) {});

  forked_child child([&] {
    // A thread of the child's own first: glibc may give it a dead thread's
    // stack, and with it a handle the watcher still holds.
    std::thread own;
    if (forked_child_may_start_threads) own = std::thread([] { std::this_thread::sleep_for(20ms); });
    watcher.reset();
    server.reset();
    try {
      if (own.joinable()) own.join();
    } catch (...) {
      return 2;  // a teardown detached the child's thread through a stale handle
    }
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung destroying the lender or the watcher";
  EXPECT_EQ(*status, 0);

  auto more = model.borrow(2 * mib, "activations");
  EXPECT_EQ(server->status().regions.size(), 2U) << "the parent's lender serves on";
  EXPECT_TRUE(watcher->watching());
}

}  // namespace
}  // namespace shoal::testing
