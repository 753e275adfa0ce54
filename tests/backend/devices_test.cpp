// Finding devices, and what happens where there is no CUDA device.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "shoal/backend/devices.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

TEST(devices, a_missing_cuda_device_is_a_typed_error_with_the_reason) {
  const int count = backend::cuda_device_count();
  try {
    (void)backend::cuda_device_instance(count);  // one past the last
    FAIL() << "expected device_unavailable";
  } catch (const device_unavailable& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)backend::cuda_device_instance(-1), device_unavailable);
  EXPECT_EQ(backend::cuda_unavailable_reason().empty(), count > 0);
}

// The runtime reports a machine with no driver at all as one whose driver is
// too old: the reason must say which it is, not send the user to upgrade a
// driver that is not there.
TEST(devices, an_insufficient_driver_says_whether_there_is_one_at_all) {
  const std::string reason = backend::cuda_unavailable_reason();
  if (reason.find("cudaErrorInsufficientDriver") == std::string::npos) {
    GTEST_SKIP() << "the CUDA runtime here does not say the driver is insufficient: " << reason;
  }
  const bool none = reason.find("no NVIDIA driver is installed here") != std::string::npos;
  const bool too_old = reason.find("the installed driver supports CUDA ") != std::string::npos &&
                       reason.find("580 or newer") != std::string::npos;
  EXPECT_TRUE(none != too_old) << reason;
}

TEST(devices, the_default_device_is_cuda_when_present_else_host) {
  ::unsetenv("SHOAL_BACKEND");
  const auto expected = backend::cuda_device_count() > 0 ? backend::device_kind::cuda : backend::device_kind::host;
  EXPECT_EQ(backend::default_device().kind(), expected);
}

TEST(devices, shoal_backend_forces_or_is_refused) {
  ::setenv("SHOAL_BACKEND", "host", 1);
  EXPECT_EQ(backend::default_device().kind(), backend::device_kind::host);
  ::setenv("SHOAL_BACKEND", "tpu", 1);
  EXPECT_THROW((void)backend::default_device(), invalid_argument);
  ::setenv("SHOAL_BACKEND", "cuda", 1);
  if (backend::cuda_device_count() == 0) {
    EXPECT_THROW((void)backend::default_device(), device_unavailable);
  } else {
    EXPECT_EQ(backend::default_device().kind(), backend::device_kind::cuda);
  }
  ::unsetenv("SHOAL_BACKEND");
}

TEST(devices, the_host_device_is_one_object) {
  EXPECT_EQ(&backend::host_device_instance(), &backend::host_device_instance());
  EXPECT_EQ(backend::host_device_instance().kind(), backend::device_kind::host);
}

}  // namespace
}  // namespace shoal::testing
