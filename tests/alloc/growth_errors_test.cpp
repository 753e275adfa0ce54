// Growth that fails with a device error rather than out of memory (host
// backend: memfd_create out of descriptors, mmap past the mapping limit; CUDA:
// any other driver error): the error reaches the caller, and the allocator
// is left as it was — no reserved bytes kept for the failed growth, no pool
// lock left held — so later allocations work.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/vmm_counting_device.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
constexpr std::size_t mib = std::size_t{1} << 20;

alloc::allocator_config expandable() { return alloc::allocator_config::parse("expandable_segments:true"); }

// map_chunks fails once, when told to, with an error that is not out of memory.
class failing_map_device : public vmm_counting_device {
 public:
  using vmm_counting_device::vmm_counting_device;
  void map_chunks(void* address, std::span<const backend::sized_chunk> chunks) override {
    if (fail_next_map.exchange(false)) throw backend_error("map_chunks", "refused by the test");
    vmm_counting_device::map_chunks(address, chunks);
  }
  std::atomic<bool> fail_next_map{false};
};

TEST(growth_errors, a_growth_failing_with_a_device_error_keeps_no_reserved_bytes) {
  failing_map_device dev(backend::host_device_instance());
  alloc::allocator_config config = expandable();
  config.memory_limit = 48 * mib;
  alloc::caching_allocator a(dev, config);
  dev.fail_next_map = true;
  EXPECT_THROW((void)a.allocate(24 * mib, {}), backend_error);
  EXPECT_EQ(dev.live_chunks(), 0) << "the chunks made for the growth went back";
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
  EXPECT_NO_THROW(a.check_invariants()) << "the failed growth's bytes are still counted as reserved";
  void* p = nullptr;
  EXPECT_NO_THROW(p = a.allocate(48 * mib, {})) << "the whole limit is there again";
  if (p != nullptr) a.deallocate(p, {});
}

// A growth of the small pool past the peak gives back the large pool's free
// chunks, under that pool's lock taken with try_lock; the stream's failed
// work surfaces there (stream_error from its synchronize). The lock must be
// let go on that error, or every later call on the large pool spins forever.
TEST(growth_errors, an_error_while_the_sibling_pool_gives_memory_back_leaves_its_lock_free) {
  auto& dev = backend::host_device_instance();
  backend::stream s(dev);
  auto a = std::make_unique<alloc::caching_allocator>(dev, expandable());
  void* first = a->allocate(24 * mib, s);
  void* second = a->allocate(24 * mib, s);
  a->deallocate(first, s);  // the large pool: 48 MiB reserved (the peak), 24 of it a free chunk
  std::atomic<bool> ran{false};
  dev.host_task(s, [&ran] {
    ran = true;
    throw std::runtime_error("a failed kernel");
  });
  while (!ran || !dev.query(s)) std::this_thread::sleep_for(1ms);
  // The small pool has nothing to give back; its growth passes the peak, so
  // the large pool gives back, and its stream's synchronize throws.
  EXPECT_THROW((void)a->allocate(512, s), stream_error);
  auto later = std::async(std::launch::async, [&] {
    void* p = a->allocate(4 * mib, s);  // the large pool again
    a->deallocate(p, s);
  });
  if (later.wait_for(5s) == std::future_status::timeout) {
    ADD_FAILURE() << "the large pool's lock was left held: its next allocation never returned";
    (void)a.release();  // leaked: its lock is held, and later.get() would wait for ever
    std::quick_exit(1);
  }
  EXPECT_NO_THROW(later.get());
  a->deallocate(second, s);
}

}  // namespace
}  // namespace shoal::testing
