// A sharing context in a fork() child of the process that made it: its
// collector's thread stayed with the parent, so destroying the context
// there (a Python child exiting does) returns instead of waiting for it;
// and the child's drops of storages it inherited take none of the locks the
// parent's threads may have held at the fork.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <system_error>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/ipc/sharing.h"
#include "shoal/storage/storage.h"
#include "support/processes.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

TEST(sharing_fork, a_forked_child_can_destroy_the_parents_context_and_its_collector) {
  alloc::caching_allocator allocator(backend::host_device_instance(), {});
  auto context = std::make_unique<ipc::sharing_context>(allocator, ipc::sharing_options{.collect_interval = 20ms});
  std::this_thread::sleep_for(30ms);  // the collector has waited once, and waits again

  forked_child child([&] {
    context.reset();
    return 0;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value()) << "the child hung destroying the context (its collector is the parent's)";
  EXPECT_EQ(*status, 0);
  EXPECT_EQ(context->collect(), 0U) << "the parent's context works on";
}

// Two peers of `context` over a socket pair: what one sends the other receives.
struct linked_peers {
  std::unique_ptr<ipc::peer> sender, receiver;
};
linked_peers link_peers(ipc::sharing_context& context) {
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) throw std::system_error(errno, std::generic_category());
  std::optional<channel::connection> theirs;
  std::thread adopting([&] { theirs.emplace(channel::connection::adopt_pair_end(unique_fd(ends[1]), {}, 1 << 20)); });
  auto sender = std::make_unique<ipc::peer>(context, channel::connection::adopt_pair_end(unique_fd(ends[0]), {}, 1 << 20));
  adopting.join();
  return {std::move(sender), std::make_unique<ipc::peer>(context, std::move(*theirs))};
}

// A DataLoader-like parent: `busy` runs over and over on another thread
// while the main thread forks up to 200 workers, each running `drop`. The
// number of forks when a worker hung (its drop waited for a lock the busy
// thread held at the fork), or 0 when none did.
int forks_until_one_hangs(const std::function<void()>& busy, const std::function<void()>& drop) {
  std::atomic<bool> stop{false};
  std::thread parent_thread([&] {
    while (!stop) busy();
  });
  int hung_at = 0;
  for (int tries = 1; tries <= 200 && hung_at == 0; ++tries) {
    forked_child child([&] {
      drop();
      return 0;
    });
    if (!child.wait_for(2s).has_value()) hung_at = tries;
  }
  stop = true;
  parent_thread.join();
  return hung_at;
}

// Each worker drops a storage it inherited that the parent had sent (its
// last handle in the child) while the parent's thread reads the context.
TEST(sharing_fork, a_forked_child_drops_an_inherited_sent_storage_while_a_parent_thread_reads_the_context) {
  alloc::caching_allocator allocator(backend::host_device_instance(), {});
  ipc::sharing_context context(allocator, ipc::sharing_options{.collect_interval = 0ms});
  linked_peers peers = link_peers(context);
  std::optional<storage::storage> sent = storage::storage::allocate(allocator, 4096, {});
  peers.sender->send(*sent);
  ipc::received got = peers.receiver->receive();  // the slot is held: the drop puts the block in the limbo

  const int hung_at = forks_until_one_hangs([&] { (void)context.holders(); }, [&] { sent.reset(); });
  EXPECT_EQ(hung_at, 0) << "a child hung dropping an inherited sent storage (fork " << hung_at << ")";
}

// The receiving side: the parent's thread makes and drops streams (the host
// device's stream registry, locked alone) and collects (the mappings' sink)
// while each worker drops a received storage it inherited, its mapping
// already retired, so its release would reach both locks.
TEST(sharing_fork, a_forked_child_drops_an_inherited_received_storage_while_a_parent_thread_works) {
  backend::device& dev = backend::host_device_instance();
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator, ipc::sharing_options{.collect_interval = 0ms});
  linked_peers peers = link_peers(context);
  const backend::stream_ref used = dev.create_stream();
  {
    std::optional<storage::storage> sent = storage::storage::allocate(allocator, 4096, {});
    peers.sender->send(*sent);
  }
  std::optional<ipc::received> got = peers.receiver->receive();
  got->storage.record_stream(used);  // used on a stream of its own: the drop looks at it
  peers.sender.reset();              // the producer went: its mapping is retired

  const int hung_at = forks_until_one_hangs(
      [&] {
        dev.destroy_stream(dev.create_stream());
        (void)context.collect();
      },
      [&] { got.reset(); });
  EXPECT_EQ(hung_at, 0) << "a child hung dropping an inherited received storage (fork " << hung_at << ")";
  got.reset();
  dev.synchronize(used);
  dev.destroy_stream(used);
}

// Without a collector nothing else marked the context as the parent's: its
// end in the child collected under the producer's lock.
TEST(sharing_fork, a_forked_child_destroys_a_context_without_a_collector_while_a_parent_thread_reads_it) {
  alloc::caching_allocator allocator(backend::host_device_instance(), {});
  auto context = std::make_unique<ipc::sharing_context>(allocator, ipc::sharing_options{.collect_interval = 0ms});
  const int hung_at = forks_until_one_hangs([&] { (void)context->holders(); }, [&] { context.reset(); });
  EXPECT_EQ(hung_at, 0) << "a child hung destroying an inherited context (fork " << hung_at << ")";
}

// The context's end removes its hooks from the allocator, under the hooks'
// lock, which a parent thread running any cache-miss hook holds.
TEST(sharing_fork, a_forked_child_destroys_the_context_while_a_parent_thread_runs_a_miss_hook) {
  alloc::caching_allocator allocator(backend::host_device_instance(), {});
  auto context = std::make_unique<ipc::sharing_context>(allocator, ipc::sharing_options{.collect_interval = 0ms});
  std::atomic<bool> armed{true}, inside{false}, released{false};
  const std::uint64_t hook = allocator.add_cache_miss_hook([&] {
    if (!armed.exchange(false)) return;
    inside = true;
    while (!released) std::this_thread::sleep_for(1ms);
  });
  std::thread allocating([&] { allocator.deallocate(allocator.allocate(1 << 20, {}), {}); });
  while (!inside) std::this_thread::sleep_for(1ms);

  forked_child child([&] {
    context.reset();
    return 0;
  });
  const std::optional<int> status = child.wait_for(5s);
  released = true;
  allocating.join();
  allocator.remove_hook(hook);
  ASSERT_TRUE(status.has_value()) << "the child hung destroying the context (the hooks' lock a parent thread held)";
  EXPECT_EQ(*status, 0);
}

}  // namespace
}  // namespace shoal::testing
