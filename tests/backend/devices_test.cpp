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
