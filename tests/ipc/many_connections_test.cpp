// A sharing context that serves many short connections stays flat: nothing
// kept per connection outlives it.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/ipc/sharing.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

std::size_t heap_in_use() { return mallinfo2().uordblks; }

// One connection's life: a producer peer and a consumer peer, a note, gone.
void one_short_connection(ipc::sharing_context& producer, ipc::sharing_context& consumer) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  ipc::peer sender(producer, channel::connection::adopt(unique_fd(fds[0]), {}));
  ipc::peer receiver(consumer, channel::connection::adopt(unique_fd(fds[1]), {}));
  const std::byte hello[1] = {std::byte{1}};
  sender.send_note(hello);
  ASSERT_EQ(receiver.receive({}).metadata.size(), 1u);
}

TEST(many_connections, a_context_serving_many_short_connections_stays_flat) {
  if (heap_in_use() == 0) GTEST_SKIP() << "mallinfo2 sees nothing under this allocator (a sanitizer's)";
  // SHOAL_TEST_CONNECTIONS=200000 for the long run; the default keeps CI short.
  const char* env = std::getenv("SHOAL_TEST_CONNECTIONS");
  const int connections = env != nullptr ? std::atoi(env) : 20000;
  backend::device& dev = backend::host_device_instance();
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_context producer(allocator, {.collect_interval = 0ms});
  ipc::sharing_context consumer(allocator, {.collect_interval = 0ms});
  for (int i = 0; i < 1000; ++i) one_short_connection(producer, consumer);  // warm up every cache
  const std::size_t before = heap_in_use();
  for (int i = 0; i < connections; ++i) one_short_connection(producer, consumer);
  const std::size_t after = heap_in_use();
  const double per_connection = (static_cast<double>(after) - static_cast<double>(before)) / connections;
  std::printf("%d connections: heap %zu -> %zu bytes (%.2f bytes per connection)\n", connections, before, after,
              per_connection);
  EXPECT_LT(per_connection, 4.0) << "memory kept per connection outlives it";
}

}  // namespace
}  // namespace shoal::testing
