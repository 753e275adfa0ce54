// A destroyed host stream's worker thread is detached before it is told to
// stop: glibc's pthread_detach reads the thread's descriptor again after
// marking it detached, and a worker told to stop first could end in between,
// free that descriptor with its stack and let another ending thread unmap it
// (a segmentation fault in pthread_detach, about once in a million streams).
// The test stands in "ended before the detach" for "could end during it".
#include <gtest/gtest.h>

#include <atomic>

#include "shoal/backend/host_device.h"
#include "support/watched_detaches.h"

namespace shoal {
namespace {

TEST(host_stream_teardown, a_destroyed_streams_worker_is_detached_before_it_may_end) {
  backend::host_device dev({.capacity_bytes = std::size_t{64} << 20});
  for (int i = 0; i < 10; ++i) {
    const backend::stream_ref s = dev.create_stream();
    std::atomic<pid_t> worker{0};
    dev.host_task(s, [&] { worker = testing::this_thread_id(); });
    dev.synchronize(s);
    const testing::watching_detach watch(worker.load());
    dev.destroy_stream(s);  // no hold on it: its executor stops at once
    ASSERT_TRUE(watch.detached()) << "the destroy detached no thread";
    EXPECT_FALSE(watch.ended_before_detach()) << "the worker could end before it was detached (round " << i << ")";
  }
}

}  // namespace
}  // namespace shoal
