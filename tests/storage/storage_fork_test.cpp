// A fork() child dropping a storage it inherited, while another of the
// parent's threads was inside the allocator (growing the same pool) at the
// fork: the child's drop must free nothing and must not wait for the lock
// that thread held (it does not exist in the child).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "shoal/storage/storage.h"
#include "support/forwarding_device.h"
#include "support/processes.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

// Holds the next segment allocation or event creation (whichever is armed;
// both are made under a lock: the pool's, a copy-on-write family's) until
// let go.
class holding_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  void* allocate_segment(std::size_t bytes) override {
    hold(armed_growth);
    return forwarding_device::allocate_segment(bytes);
  }
  backend::physical_ref create_physical(std::size_t bytes) override {
    hold(armed_growth);
    return forwarding_device::create_physical(bytes);
  }
  backend::event_ref create_event() override {
    hold(armed_event);
    return forwarding_device::create_event();
  }
  void hold(std::atomic<bool>& armed) {
    if (!armed.exchange(false)) return;
    inside = true;
    while (!released) std::this_thread::sleep_for(1ms);
  }
  std::atomic<bool> armed_growth{false}, armed_event{false}, inside{false}, released{false};
};

// Once `parent_thread` is held inside `dev` (a lock of the parent's held),
// forks a child that runs `drop`; then lets the thread go and joins it. The
// child's exit status, or none when it hung.
std::optional<int> drop_in_child_while_held(holding_device& dev, std::thread& parent_thread,
                                            const std::function<void()>& drop) {
  while (!dev.inside) std::this_thread::sleep_for(1ms);
  forked_child child([&] {
    drop();
    return 0;
  });
  const std::optional<int> status = child.wait_for(5s);
  dev.released = true;
  parent_thread.join();
  return status;
}

TEST(storage_fork, a_forked_child_drops_an_inherited_storage_while_a_parent_thread_grows_its_pool) {
  backend::host_device host;
  holding_device dev(host);
  alloc::caching_allocator allocator(dev, alloc::allocator_config{});
  std::optional<storage::storage> kept = storage::storage::allocate(allocator, 2 << 20, {});
  dev.armed_growth = true;
  std::thread grower([&] {
    // Larger than what the first segment has left: the pool grows, its lock held.
    try {
      void* p = allocator.allocate(std::size_t{30} << 20, {});
      allocator.deallocate(p, {});
    } catch (...) {
    }
  });
  // What a DataLoader worker's drop of an inherited storage does:
  const std::optional<int> status = drop_in_child_while_held(dev, grower, [&] { kept.reset(); });
  ASSERT_TRUE(status.has_value()) << "the child hung dropping an inherited storage";
  EXPECT_EQ(*status, 0);
}

// A lazy clone's family: a parent thread's write copies out of the shared
// data (its event is made under the family's lock) while a worker forks and
// drops an inherited member of that family.
TEST(storage_fork, a_forked_child_drops_an_inherited_lazy_clone_while_a_parent_thread_materializes_its_family) {
  backend::host_device host;
  holding_device dev(host);
  alloc::caching_allocator allocator(dev, alloc::allocator_config{});
  std::optional<storage::storage> source = storage::storage::allocate(allocator, 4096, {});
  storage::storage clone = storage::lazy_clone(*source, {});
  dev.armed_event = true;
  std::thread writer([&] { (void)clone.mutable_data({}); });  // a copy: the family has two members
  // The family's reference goes: cow_context::release_for_drop.
  const std::optional<int> status = drop_in_child_while_held(dev, writer, [&] { source.reset(); });
  ASSERT_TRUE(status.has_value()) << "the child hung dropping an inherited lazy clone (the family's lock)";
  EXPECT_EQ(*status, 0);
}

// What would use an inherited block further is refused in the child, as
// allocate is, before any lock: a take_over there (which asks the block's
// size and claims it) says why, whatever the parent's threads were doing.
TEST(storage_fork, a_forked_child_is_refused_a_take_over_of_an_inherited_block) {
  alloc::caching_allocator allocator(backend::host_device_instance(), alloc::allocator_config{});
  void* block = allocator.allocate(4096, {});
  forked_child child([&] {
    try {
      (void)storage::storage::take_over(allocator, block, 4096, {});
    } catch (const device_unavailable& e) {
      return std::string(e.what()).find("fork() child") != std::string::npos ? 0 : 2;
    } catch (...) {
      return 3;
    }
    return 1;
  });
  const std::optional<int> status = child.wait_for(10s);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0) << "1: taken over, 2: refused without saying why, 3: another error";
  storage::storage own = storage::storage::take_over(allocator, block, 4096, {});  // the parent's still may
  EXPECT_EQ(own.size(), 4096u);
}

}  // namespace
}  // namespace shoal::testing
