// lending::revocation_watcher: a borrower's revokes passed to a callback on
// a thread of its own, which stops within its 10 ms look (from any thread,
// from several at once, from the callback, by its destructor), calls back no
// more once stopped, and keeps what ended it (host backend, in one process).
#include "shoal/lending/revocation_watcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
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

  /// Two regions revoked and their revokes read by the borrower (kept for
  /// its next revocations(), which returns both at once: one batch).
  std::vector<lending::borrowed_region> two_revoked_in_one_batch() {
    std::vector<lending::borrowed_region> held;
    held.push_back(model.borrow(2 * mib, "parameters"));
    held.push_back(model.borrow(2 * mib, "activations"));
    for (const auto& r : held) l->revoke(r.id(), std::chrono::seconds(5));
    EXPECT_TRUE(eventually([&] { return l->status().revocations == 2; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // both revokes on the socket
    (void)model.metrics();  // its answer comes after them: both are read and kept
    return held;
  }
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
  // Two threads stop it at once: one joins, both return once it ended.
  const auto start = clock_type::now();
  std::thread other([&] { watcher.stop(); });
  watcher.stop();
  other.join();
  EXPECT_LT(clock_type::now() - start, std::chrono::milliseconds(500)) << "stop() waited past the watcher's look";
  EXPECT_FALSE(watcher.watching());
  EXPECT_EQ(watcher.error(), nullptr);
  // Stopped, it reads no more: a later revoke is the borrower's to read.
  auto later = f.model.borrow(2 * mib, "later");
  f.l->revoke(later.id(), std::chrono::seconds(5));
  const auto read = f.model.revocations(std::chrono::seconds(5));
  ASSERT_EQ(read.size(), 1u);
  EXPECT_EQ(read[0].region, later.id());
  EXPECT_THROW(revocation_watcher(f.model, {}), invalid_argument) << "an empty callback";
}

TEST(lending_revocation_watcher, its_callback_may_give_the_region_back_itself) {
  watched_lender f;
  std::mutex m;
  std::vector<lending::borrowed_region> held;
  held.push_back(f.model.borrow(2 * mib, "model A"));
  const std::uint64_t id = held.back().id();
  revocation_watcher watcher(f.model, [&](const borrower::revocation& r) {
    const std::lock_guard lock(m);
    for (auto& region : held) {
      if (region.valid() && region.id() == r.region) f.model.give_back(std::move(region));
    }
  });
  f.l->revoke(id, std::chrono::seconds(5));
  ASSERT_TRUE(eventually([&] { return f.l->status().lent_bytes == 0; })) << "the callback's give back did not go";
  EXPECT_EQ(f.l->status().revocations_missed, 0u);
  watcher.stop();
  EXPECT_EQ(watcher.error(), nullptr);
}

TEST(lending_revocation_watcher, its_destructor_stops_it_and_no_callback_comes_after) {
  watched_lender f;
  std::atomic<int> calls{0};
  auto sentinel = std::make_shared<int>(0);
  const std::weak_ptr<int> callback_alive = sentinel;
  {
    revocation_watcher watcher(f.model, [&calls, sentinel](const borrower::revocation&) { ++calls; });
    sentinel.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // in its wait for revokes
  }
  EXPECT_TRUE(callback_alive.expired()) << "the destructor returned before the thread ended";
  auto region = f.model.borrow(2 * mib, "model A");
  f.l->revoke(region.id(), std::chrono::seconds(5));
  const auto read = f.model.revocations(std::chrono::seconds(5));
  ASSERT_EQ(read.size(), 1u) << "the destroyed watcher's thread still read revokes";
  EXPECT_EQ(calls.load(), 0);
}

TEST(lending_revocation_watcher, stopped_from_its_callback_it_calls_back_no_more) {
  watched_lender f;
  const auto held = f.two_revoked_in_one_batch();
  // The watcher is reached from its callback through an atomic: what the
  // socket orders between the threads, a race detector does not see.
  std::atomic<revocation_watcher*> self{nullptr};
  std::atomic<int> calls{0};
  const auto watcher = std::make_unique<revocation_watcher>(f.model, [&](const borrower::revocation&) {
    ++calls;
    revocation_watcher* w = nullptr;
    while ((w = self.load()) == nullptr) std::this_thread::yield();  // it may run before the constructor returns
    w->stop();  // on its own thread: no join on itself
  });
  self = watcher.get();
  ASSERT_TRUE(eventually([&] { return !watcher->watching(); }));
  EXPECT_EQ(calls.load(), 1) << "called back after it was stopped";
  EXPECT_EQ(watcher->error(), nullptr) << "stopping from the callback failed";
  const auto back = f.model.revocations();  // the revoke it did not pass on went back to the borrower
  ASSERT_EQ(back.size(), 1u) << "a revoke read and not passed on was lost";
  EXPECT_EQ(back[0].region, held[1].id());
  f.model.return_revocations(back);
  f.model.return_revocations(back);
  EXPECT_EQ(f.model.revocations().size(), 1u) << "a revoke put back twice comes back twice";
}

// A revoke put back whose region's give back the lender confirmed meanwhile
// is left out: the next reader is not asked again for a region it gave back.
TEST(lending_revocation_watcher, a_revoke_put_back_for_a_region_given_back_meanwhile_is_left_out) {
  watched_lender f;
  auto held = f.two_revoked_in_one_batch();
  std::atomic<revocation_watcher*> self{nullptr};
  const auto watcher = std::make_unique<revocation_watcher>(f.model, [&](const borrower::revocation&) {
    f.model.give_back(std::move(held[1]));  // the next revoke's region
    revocation_watcher* w = nullptr;
    while ((w = self.load()) == nullptr) std::this_thread::yield();
    w->stop();
  });
  self = watcher.get();
  ASSERT_TRUE(eventually([&] { return !watcher->watching(); }));
  EXPECT_TRUE(f.model.revocations().empty()) << "a revoke came back for a region given back";
}

TEST(lending_revocation_watcher, destroyed_from_its_callback_it_ends_and_lets_go_of_the_callback) {
  watched_lender f;
  const auto held = f.two_revoked_in_one_batch();
  std::atomic<revocation_watcher*> owned{nullptr};
  std::atomic<int> calls{0};
  auto sentinel = std::make_shared<int>(0);
  const std::weak_ptr<int> callback_alive = sentinel;
  auto* watcher = new revocation_watcher(f.model, [&, sentinel](const borrower::revocation&) {
    ++calls;
    revocation_watcher* w = nullptr;
    while ((w = owned.exchange(nullptr)) == nullptr) std::this_thread::yield();  // once its constructor returned
    delete w;  // destroyed on its own thread: it ends once this returns
  });
  sentinel.reset();
  owned = watcher;
  ASSERT_TRUE(eventually([&] { return callback_alive.expired(); })) << "the thread kept the callback";
  EXPECT_EQ(calls.load(), 1) << "called back after the watcher was destroyed";
  const auto back = f.model.revocations();
  ASSERT_EQ(back.size(), 1u) << "a revoke read and not passed on was lost";
  EXPECT_EQ(back[0].region, held[1].id());
}

// Destroyed from its callback, whose owner then destroys the borrower: the
// watcher's thread touches the borrower no more once that callback returns
// (what it had not passed on went back while the callback ran). A use after
// free here is AddressSanitizer's to see.
TEST(lending_revocation_watcher, destroyed_from_its_callback_it_leaves_the_borrower_to_its_owner) {
  watched_lender f;
  auto model = std::make_unique<borrower>(f.dev, f.l->address());
  std::vector<lending::borrowed_region> held;
  held.push_back(model->borrow(2 * mib, "parameters"));
  held.push_back(model->borrow(2 * mib, "activations"));
  for (const auto& r : held) f.l->revoke(r.id(), std::chrono::seconds(5));
  ASSERT_TRUE(eventually([&] { return f.l->status().revocations == 2; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  (void)model->metrics();  // both revokes read and kept: one batch
  std::atomic<revocation_watcher*> owned{nullptr};
  // Atomics, not futures: the callback's last touch of them must come before
  // the test's end (the thread is detached), which a future's wait cannot say.
  std::atomic<bool> deleted{false}, borrower_gone{false}, callback_done{false};
  auto* watcher = new revocation_watcher(*model, [&](const borrower::revocation&) {
    revocation_watcher* w = nullptr;
    while ((w = owned.exchange(nullptr)) == nullptr) std::this_thread::yield();
    delete w;
    deleted.store(true);
    while (!borrower_gone.load()) std::this_thread::yield();  // the owner drops the borrower meanwhile
    callback_done.store(true);
  });
  owned = watcher;
  while (!deleted.load()) std::this_thread::yield();
  held.clear();
  model.reset();
  borrower_gone.store(true);
  while (!callback_done.load()) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the thread ends meanwhile, touching no borrower
}

TEST(lending_revocation_watcher, keeps_what_ended_it) {
  watched_lender f;
  const auto held = f.two_revoked_in_one_batch();
  std::atomic<int> calls{0};
  revocation_watcher failing(f.model, [&](const borrower::revocation&) {
    ++calls;
    throw std::runtime_error("the handler failed");
  });
  ASSERT_TRUE(eventually([&] { return !failing.watching(); }));
  ASSERT_NE(failing.error(), nullptr);
  EXPECT_THROW(std::rethrow_exception(failing.error()), std::runtime_error);
  EXPECT_EQ(calls.load(), 1) << "called back again after the callback threw";
  EXPECT_EQ(f.model.revocations().size(), 2u) << "the revoke whose callback threw and the next went back";

  // The lender gone: the connection's error ends the watcher.
  revocation_watcher orphaned(f.model, [](const borrower::revocation&) {});
  f.l.reset();
  ASSERT_TRUE(eventually([&] { return !orphaned.watching(); }));
  ASSERT_NE(orphaned.error(), nullptr);
  EXPECT_THROW(std::rethrow_exception(orphaned.error()), connection_closed);
}

}  // namespace
}  // namespace shoal::testing
