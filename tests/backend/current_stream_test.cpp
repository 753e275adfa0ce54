// The per-thread current stream and its scoped guard.
#include <gtest/gtest.h>

#include <thread>

#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "support/backends.h"

namespace shoal::testing {
namespace {

using backend::current_stream;
using backend::stream;
using backend::stream_guard;

template <class Backend>
using current_stream_test = backend_test<Backend>;
TYPED_TEST_SUITE(current_stream_test, backend_types, backend_names);

TYPED_TEST(current_stream_test, starts_as_the_default_stream) {
  EXPECT_TRUE(current_stream(this->device()).is_default());
}

TYPED_TEST(current_stream_test, guards_set_nest_and_restore) {
  auto& dev = this->device();
  stream a(dev);
  stream b(dev);
  {
    stream_guard outer(dev, a);
    EXPECT_EQ(current_stream(dev), a.ref());
    {
      stream_guard inner(dev, b);
      EXPECT_EQ(current_stream(dev), b.ref());
    }
    EXPECT_EQ(current_stream(dev), a.ref());
  }
  EXPECT_TRUE(current_stream(dev).is_default());
}

TYPED_TEST(current_stream_test, is_per_thread) {
  auto& dev = this->device();
  stream a(dev);
  stream_guard guard(dev, a);
  backend::stream_ref seen_elsewhere{&guard};
  std::thread([&] { seen_elsewhere = current_stream(dev); }).join();
  EXPECT_TRUE(seen_elsewhere.is_default());
  EXPECT_EQ(current_stream(dev), a.ref());
}

TEST(current_stream, is_per_device) {
  backend::host_device first;
  backend::host_device second;
  stream a(first);
  stream_guard guard(first, a);
  EXPECT_EQ(current_stream(first), a.ref());
  EXPECT_TRUE(current_stream(second).is_default());
}

}  // namespace
}  // namespace shoal::testing
