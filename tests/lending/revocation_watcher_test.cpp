// lending::revocation_watcher: a borrower's revokes passed to a callback on
// a thread of its own, which stops within its 10 ms look, may be stopped
// from the callback, and keeps what ended it (host backend, in one process).
#include "shoal/lending/revocation_watcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "lending/lending_fixture.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using clock_type = std::chrono::steady_clock;
using lending::revocation_watcher;

struct watched_lender {
  temp_dir dir;
  backend::device& dev = backend::host_device_instance();
  std::unique_ptr<lender> l =
      std::make_unique<lender>(dev, channel::channel_address::at_path(dir / "l.sock"), lender_config{});
  borrower model{dev, l->address()};
};

TEST(lending_revocation_watcher, calls_back_for_each_revoke_on_its_own_thread_and_stops_soon) {
  watched_lender f;
  auto parameters = f.model.borrow(2 * mib, "parameters");
  auto activations = f.model.borrow(2 * mib, "activations");
  std::mutex m;
  std::vector<std::uint64_t> asked;
  bool on_caller_thread = false;
  const auto caller = std::this_thread::get_id();
  revocation_watcher watcher(f.model, [&](const borrower::revocation& r) {
    const std::lock_guard lock(m);
    asked.push_back(r.region);
    on_caller_thread = on_caller_thread || std::this_thread::get_id() == caller;
  });
  EXPECT_TRUE(watcher.watching());
  f.l->revoke(parameters.id(), std::chrono::seconds(5));
  f.l->revoke(activations.id(), std::chrono::seconds(5));
  ASSERT_TRUE(eventually([&] {
    const std::lock_guard lock(m);
    return asked.size() == 2;
  }));
  {
    const std::lock_guard lock(m);
    std::sort(asked.begin(), asked.end());
    EXPECT_EQ(asked, (std::vector<std::uint64_t>{std::min(parameters.id(), activations.id()),
                                                 std::max(parameters.id(), activations.id())}));
    EXPECT_FALSE(on_caller_thread);
  }
  const auto start = clock_type::now();
  watcher.stop();
  EXPECT_LT(clock_type::now() - start, std::chrono::milliseconds(500)) << "stop() waited past the watcher's look";
  EXPECT_FALSE(watcher.watching());
  EXPECT_EQ(watcher.error(), nullptr);
  // Stopped, it reads no more: a later revoke is the borrower's to read.
  auto later = f.model.borrow(2 * mib, "later");
  f.l->revoke(later.id(), std::chrono::seconds(5));
  const auto read = f.model.revocations(std::chrono::seconds(5));
  ASSERT_EQ(read.size(), 1u);
  EXPECT_EQ(read[0].region, later.id());
}

TEST(lending_revocation_watcher, may_be_stopped_and_destroyed_from_its_callback) {
  watched_lender f;
  auto region = f.model.borrow(2 * mib, "model A");
  // The watchers are reached from their callbacks through atomics: what the
  // socket orders between the threads, a race detector does not see.
  std::atomic<revocation_watcher*> stopping{nullptr};
  std::atomic<bool> called{false};
  const auto watcher = std::make_unique<revocation_watcher>(f.model, [&](const borrower::revocation&) {
    stopping.load()->stop();  // on its own thread: no join on itself
    called = true;
  });
  stopping = watcher.get();
  f.l->revoke(region.id(), std::chrono::seconds(5));
  ASSERT_TRUE(eventually([&] { return !watcher->watching(); }));
  EXPECT_TRUE(called.load());
  EXPECT_EQ(watcher->error(), nullptr) << "stopping from the callback failed";

  auto second = f.model.borrow(2 * mib, "model A again");
  std::atomic<revocation_watcher*> owned{nullptr};
  std::atomic<bool> destroyed{false};
  owned = new revocation_watcher(f.model, [&](const borrower::revocation&) {
    delete owned.exchange(nullptr);  // destroyed on its own thread: it ends once this returns
    destroyed = true;
  });
  f.l->revoke(second.id(), std::chrono::seconds(5));
  ASSERT_TRUE(eventually([&] { return destroyed.load(); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // its thread ends on its own
}

TEST(lending_revocation_watcher, keeps_what_ended_it) {
  watched_lender f;
  auto region = f.model.borrow(2 * mib, "model A");
  std::atomic<int> calls{0};
  revocation_watcher failing(f.model, [&](const borrower::revocation&) {
    ++calls;
    throw std::runtime_error("the handler failed");
  });
  f.l->revoke(region.id(), std::chrono::seconds(5));
  ASSERT_TRUE(eventually([&] { return !failing.watching(); }));
  ASSERT_NE(failing.error(), nullptr);
  EXPECT_THROW(std::rethrow_exception(failing.error()), std::runtime_error);
  EXPECT_EQ(calls.load(), 1);

  // The lender gone: the connection's error ends the watcher.
  revocation_watcher orphaned(f.model, [](const borrower::revocation&) {});
  f.l.reset();
  ASSERT_TRUE(eventually([&] { return !orphaned.watching(); }));
  ASSERT_NE(orphaned.error(), nullptr);
  EXPECT_THROW(std::rethrow_exception(orphaned.error()), connection_closed);
}

}  // namespace
}  // namespace shoal::testing
