#include "support/descriptors.h"

#include <chrono>
#include <filesystem>

#include "core/descriptor_closer.h"

namespace shoal::testing {

void wait_for_the_closer() {
  EXPECT_TRUE(shoal::detail::off_thread_closes_done_within(std::chrono::seconds(30)))
      << "the closer thread has not closed what it was handed";
}

std::size_t open_descriptor_count() {
  wait_for_the_closer();
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

}  // namespace shoal::testing
