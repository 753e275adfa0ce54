// The engine when the host refuses it something: threads it cannot start
// (a pids cgroup limit, RLIMIT_NPROC) are a typed error from its
// constructor, not the end of the process.
#include <gtest/gtest.h>

#include <string>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/transfer/transfer_engine.h"
#include "support/backends.h"
#include "support/refused_threads.h"

namespace shoal::testing {
namespace {

using backend::stream;
using transfer::transfer_engine;

template <class Backend>
class transfer_engine_host_failures : public backend_test<Backend> {};
TYPED_TEST_SUITE(transfer_engine_host_failures, backend_types, backend_names);

TYPED_TEST(transfer_engine_host_failures, staging_helpers_that_cannot_all_be_started_are_a_backend_error) {
  stream copy_stream(this->device());
  alloc::caching_allocator a(this->device(), {});
  try {
    refusing_threads refusal(2);  // two of the four helpers start, the third does not
    transfer_engine engine(a, copy_stream.ref(), {.staging_helpers = 4});
    ADD_FAILURE() << "the engine started four helpers where only two could";
  } catch (const backend_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("2 of 4"), std::string::npos) << what;
    EXPECT_NE(what.find("staging_helpers"), std::string::npos) << "names the setting that asks for them: " << what;
  }
}

TYPED_TEST(transfer_engine_host_failures, an_engine_thread_that_cannot_be_started_is_a_backend_error) {
  stream copy_stream(this->device());
  alloc::caching_allocator a(this->device(), {});
  refusing_threads refusal(2);  // both helpers start, the engine's own thread does not
  EXPECT_THROW(transfer_engine(a, copy_stream.ref(), {.staging_helpers = 2}), backend_error);
  EXPECT_EQ(refusal.refused(), 1);
}

}  // namespace
}  // namespace shoal::testing
