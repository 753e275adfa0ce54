// A sharing context in a fork() child of the process that made it: its
// collector's thread stayed with the parent, so destroying the context
// there (a Python child exiting does) returns instead of waiting for it;
// and the child's drops of storages it inherited take none of the locks the
// parent's threads may have held at the fork.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
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

// A DataLoader-like parent: another thread reads the context's holders while
// the main thread forks workers; each worker drops a storage it inherited
// that the parent had sent (its last handle in the child).
TEST(sharing_fork, a_forked_child_drops_an_inherited_sent_storage_while_a_parent_thread_reads_the_context) {
  alloc::caching_allocator allocator(backend::host_device_instance(), {});
  ipc::sharing_context context(allocator, ipc::sharing_options{.collect_interval = 0ms});
  int ends[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends), 0);
  std::optional<channel::connection> theirs;
  std::thread adopting([&] { theirs.emplace(channel::connection::adopt_pair_end(unique_fd(ends[1]), {}, 1 << 20)); });
  ipc::peer sender(context, channel::connection::adopt_pair_end(unique_fd(ends[0]), {}, 1 << 20));
  adopting.join();
  ipc::peer receiver(context, std::move(*theirs));
  std::optional<storage::storage> sent = storage::storage::allocate(allocator, 4096, {});
  sender.send(*sent);
  ipc::received got = receiver.receive();  // the slot is held: the drop puts the block in the limbo

  std::atomic<bool> stop{false};
  std::thread reader([&] {
    while (!stop) (void)context.holders();
  });
  int hung = 0, tries = 0;
  for (; tries < 200 && hung == 0; ++tries) {
    forked_child child([&] {
      sent.reset();
      return 0;
    });
    if (!child.wait_for(2s).has_value()) ++hung;
  }
  stop = true;
  reader.join();
  EXPECT_EQ(hung, 0) << "a child hung dropping an inherited sent storage (after " << tries << " forks)";
}

// The receiving side: workers forked while another thread makes and drops
// streams (the host device's stream registry, locked alone) and collects
// (the mappings' sink) drop a received storage they inherited, its mapping
// already retired, so its release would reach both locks.
TEST(sharing_fork, a_forked_child_drops_an_inherited_received_storage_while_a_parent_thread_works) {
  backend::device& dev = backend::host_device_instance();
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context context(allocator, ipc::sharing_options{.collect_interval = 0ms});
  int ends[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends), 0);
  std::optional<channel::connection> theirs;
  std::thread adopting([&] { theirs.emplace(channel::connection::adopt_pair_end(unique_fd(ends[1]), {}, 1 << 20)); });
  auto sender = std::make_unique<ipc::peer>(context, channel::connection::adopt_pair_end(unique_fd(ends[0]), {}, 1 << 20));
  adopting.join();
  ipc::peer receiver(context, std::move(*theirs));
  const backend::stream_ref used = dev.create_stream();
  {
    std::optional<storage::storage> sent = storage::storage::allocate(allocator, 4096, {});
    sender->send(*sent);
  }
  std::optional<ipc::received> got = receiver.receive();
  got->storage.record_stream(used);  // used on a stream of its own: the drop looks at it
  sender.reset();                         // the producer went: its mapping is retired

  std::atomic<bool> stop{false};
  std::thread worker([&] {
    while (!stop) {
      dev.destroy_stream(dev.create_stream());
      (void)context.collect();
    }
  });
  int hung = 0, tries = 0;
  for (; tries < 200 && hung == 0; ++tries) {
    forked_child child([&] {
      got.reset();
      return 0;
    });
    if (!child.wait_for(2s).has_value()) ++hung;
  }
  stop = true;
  worker.join();
  EXPECT_EQ(hung, 0) << "a child hung dropping an inherited received storage (after " << tries << " forks)";
  got.reset();
  dev.synchronize(used);
  dev.destroy_stream(used);
}

}  // namespace
}  // namespace shoal::testing
