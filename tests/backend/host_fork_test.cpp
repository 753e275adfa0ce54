// A fork() child of a process that opened a host device: the device's
// worker threads stayed with the parent, so stream work and waits on work
// enqueued before the fork give device_unavailable (as CUDA refuses a
// forked child), and destroying the device there returns instead of waiting
// for threads that are not in the child.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>

#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "support/processes.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

template <class Call>
bool refused_as_unavailable(const Call& call) {
  try {
    call();
  } catch (const device_unavailable&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

TEST(host_device_fork, a_forked_child_is_refused_stream_work_and_can_destroy_the_parents_device) {
  auto dev = std::make_unique<backend::host_device>();
  void* buffer = dev->allocate_segment(4096);
  const backend::stream_ref side = dev->create_stream();
  std::atomic<bool> open{false};
  // Work still queued at the fork: the child's copy of the stream never runs it.
  dev->host_task(side, [&] {
    while (!open.load()) std::this_thread::sleep_for(1ms);
  });
  const backend::event_ref pending = dev->create_event();
  dev->record(pending, side);

  forked_child child([&] {
    if (!refused_as_unavailable([&] { dev->fill(side, buffer, 1, 4096); })) return 1;
    if (!refused_as_unavailable([&] { dev->synchronize(side); })) return 2;
    if (!refused_as_unavailable([&] { (void)dev->create_stream(); })) return 3;
    if (!refused_as_unavailable([&] { dev->synchronize_event(pending); })) return 4;
    try {
      dev->synchronize(backend::stream_ref{});  // nothing was queued there: nothing to wait for
    } catch (...) {
      return 5;
    }
    dev.reset();  // a Python child exiting destroys what it inherited
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung (waiting for the parent's stream threads)";
  EXPECT_EQ(*status, 0) << "1: fill enqueued, 2: synchronize passed, 3: a stream was made, 4: the event wait "
                           "passed, 5: an idle stream's synchronize failed";

  // The parent's device goes on as before.
  open.store(true);
  dev->synchronize_event(pending);
  dev->fill(side, buffer, 7, 4096);
  dev->synchronize(side);
  EXPECT_EQ(static_cast<unsigned char*>(buffer)[4095], 7);
  dev->destroy_event(pending);
  dev->destroy_stream(side);
  dev->free_segment(buffer);
}

}  // namespace
}  // namespace shoal::testing
