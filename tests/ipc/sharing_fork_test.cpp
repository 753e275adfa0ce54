// A sharing context in a fork() child of the process that made it: its
// collector's thread stayed with the parent, so destroying the context
// there (a Python child exiting does) returns instead of waiting for it.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/ipc/sharing.h"
#include "support/processes.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

TEST(sharing_fork, a_forked_child_can_destroy_the_parents_context_and_its_collector) {
  alloc::caching_allocator allocator(backend::host_device_instance(), {});
  auto context = std::make_unique<ipc::sharing_context>(allocator, ipc::sharing_options{.collect_interval = 20ms});
  std::this_thread::sleep_for(30ms);  // the collector has waited once, and waits again

  forked_child child([&] {
    context.reset();
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung destroying the context (its collector is the parent's)";
  EXPECT_EQ(*status, 0);
  EXPECT_EQ(context->collect(), 0U) << "the parent's context works on";
}

}  // namespace
}  // namespace shoal::testing
