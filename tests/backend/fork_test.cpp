// A fork() child of a process that opened a device. Host: the device's
// worker threads stayed with the parent, so stream work and waits on work
// enqueued before the fork give device_unavailable, and destroying the
// device there returns instead of waiting for threads that are not in the
// child. CUDA refuses a forked child every call; shoal says why, with the
// same error.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>

#include "shoal/backend/devices.h"
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
  } catch (const device_unavailable& e) {
    return std::string_view(e.what()).find("fork()") != std::string_view::npos;
  } catch (...) {
    return false;
  }
  return false;
}

TEST(host_device_fork, a_forked_child_is_refused_stream_work_and_memory_and_can_destroy_the_parents_device) {
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
    // An allocator made in the child would hand out memory no stream there can use.
    if (!refused_as_unavailable([&] { (void)dev->allocate_segment(4096); })) return 6;
    if (!refused_as_unavailable([&] { (void)dev->allocate_pinned_host(4096); })) return 7;
    if (!refused_as_unavailable([&] { (void)dev->reserve_range(dev->granularity()); })) return 8;
    if (!refused_as_unavailable([&] { (void)dev->create_physical(dev->granularity()); })) return 9;
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
                           "passed, 5: an idle stream's synchronize failed, 6-9: memory was made (segment, pinned, "
                           "range, chunk)";

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

// Another of the parent's threads makes and drops streams and events (the
// device's registry, locked alone) while workers fork: each worker drops the
// streams and events it inherited (a Python child's exit or gc does) and asks
// about a stream, without waiting for that lock.
TEST(host_device_fork, a_forked_child_drops_and_asks_about_inherited_streams_while_a_parent_thread_makes_some) {
  backend::host_device dev;
  const backend::stream_ref asked = dev.create_stream();
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop) {
      dev.destroy_stream(dev.create_stream());
      dev.destroy_event(dev.create_event());
    }
  });
  int hung_at = 0;
  for (int tries = 1; tries <= 300 && hung_at == 0; ++tries) {
    const backend::stream_ref dropped = dev.create_stream();
    const backend::event_ref event = dev.create_event();
    forked_child child([&] {
      dev.destroy_event(event);
      dev.destroy_stream(dropped);
      if (dev.stream_destroy_pending(dropped)) return 2;  // the holds' lock: a destroy's
      return refused_as_unavailable([&] { (void)dev.query(asked); }) ? 0 : 1;
    });
    const std::optional<int> status = child.wait_for(2s);
    if (!status.has_value()) {
      hung_at = tries;
    } else {
      EXPECT_EQ(*status, 0) << "the child's query of an inherited stream was not refused";
    }
    dev.destroy_event(event);
    dev.destroy_stream(dropped);
  }
  stop = true;
  churn.join();
  EXPECT_EQ(hung_at, 0) << "a child hung on the device's registry (fork " << hung_at << ")";
  dev.destroy_stream(asked);
}

TEST(cuda_device_fork, a_forked_child_is_told_that_cuda_is_the_parents) {
  if (const std::string reason = backend::cuda_unavailable_reason(); !reason.empty()) GTEST_SKIP() << reason;
  backend::device& dev = backend::cuda_device_instance(0);
  void* buffer = dev.allocate_segment(1 << 20);
  const backend::stream_ref side = dev.create_stream();
  dev.fill(side, buffer, 1, 1 << 20);
  dev.synchronize(side);

  forked_child child([&] {
    if (!refused_as_unavailable([&] { dev.fill(side, buffer, 2, 1 << 20); })) return 1;
    if (!refused_as_unavailable([&] { (void)dev.create_stream(); })) return 2;
    return 0;
  });
  const std::optional<int> status = child.wait_for(30s);
  ASSERT_TRUE(status.has_value()) << "the child hung";
  EXPECT_EQ(*status, 0) << "1: the fill was not refused as device_unavailable naming fork(), 2: nor the stream";

  dev.fill(side, buffer, 3, 1 << 20);  // the parent's device goes on
  dev.synchronize(side);
  dev.destroy_stream(side);
  dev.free_segment(buffer);
}

}  // namespace
}  // namespace shoal::testing
