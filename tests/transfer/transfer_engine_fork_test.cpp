// A transfer engine in a fork() child of the process that made it: its
// worker and staging helpers stayed with the parent, so destroying the
// engine there (a Python child exiting does) returns instead of waiting for
// them, submitting or taking there is device_unavailable (nothing would
// ever be copied), and the parent's engine goes on.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/transfer/transfer_engine.h"
#include "support/processes.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

TEST(transfer_engine_fork, a_forked_child_can_destroy_the_parents_engine) {
  backend::device& dev = backend::host_device_instance();
  backend::stream copies(dev);
  alloc::caching_allocator allocator(dev, {});
  auto engine = std::make_unique<transfer::transfer_engine>(allocator, copies.ref(), transfer::transfer_config{});
  auto bytes = std::make_shared<std::vector<std::uint8_t>>(4096, 7);
  engine->submit({transfer::host_buffer{bytes->data(), bytes->size(), false, bytes}});
  (void)engine->next();  // the worker has run, and waits for more

  forked_child child([&] {
    // A thread of the child's own first: glibc gives it the dead worker's
    // stack, and with it the handle the engine still holds.
    std::thread own;
    if (forked_child_may_start_threads) own = std::thread([] { std::this_thread::sleep_for(20ms); });
    engine.reset();
    try {
      if (own.joinable()) own.join();
    } catch (...) {
      return 2;  // the engine's teardown detached the child's thread through its stale handle
    }
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung destroying the engine (its threads are the parent's)";
  EXPECT_EQ(*status, 0) << "2: the child's own thread was detached by the engine's teardown";

  engine->submit({transfer::host_buffer{bytes->data(), bytes->size(), false, bytes}});
  const transfer::transferred_batch batch = engine->next();
  batch.synchronize();
  EXPECT_EQ(batch.storages().size(), 1U) << "the parent's engine goes on";
}

// A forking data loader's worker that uses the parent's engine: refused at
// once, never a batch accepted that no thread will copy, and stats() too
// (the parent's thread may have held the engine's lock at the fork).
TEST(transfer_engine_fork, a_forked_child_is_refused_submit_next_and_stats) {
  backend::device& dev = backend::host_device_instance();
  backend::stream copies(dev);
  alloc::caching_allocator allocator(dev, {});
  transfer::transfer_engine engine(allocator, copies.ref(), transfer::transfer_config{});
  auto bytes = std::make_shared<std::vector<std::uint8_t>>(4096, 7);
  forked_child child([&] {
    try {
      (void)engine.submit({transfer::host_buffer{bytes->data(), bytes->size(), false, bytes}}, 1s);
      return 1;
    } catch (const device_unavailable&) {
    }
    try {
      (void)engine.next(1s);
      return 2;
    } catch (const device_unavailable&) {
    }
    try {
      (void)engine.try_next();
      return 3;
    } catch (const device_unavailable&) {
    }
    try {
      (void)engine.stats();
      return 4;
    } catch (const device_unavailable&) {
    }
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung in the parent's engine";
  EXPECT_EQ(*status, 0) << "1: submit, 2: next, 3: try_next, 4: stats was not refused";
}

}  // namespace
}  // namespace shoal::testing
