// Grouped loading on both backends: every layer, waiting only for its own
// group, reads that group's final bytes while later groups are still being
// copied (and an unsafe control that skips the waits reads stale bytes);
// bad loads refused before anything is enqueued; sources held until the
// load is gone; the copy cost measured.
#include "shoal/transfer/grouped_load.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "shoal/core/error.h"
#include "shoal/transfer/group_planner.h"
#include "support/backends.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using transfer::group_copy;
using transfer::load_group;
using transfer::load_groups;
constexpr std::size_t mib = std::size_t{1} << 20;

/// Pinned sources and device destinations of a model of `groups` groups,
/// two copies each; group g's source bytes are all pattern(g), and the
/// destinations start as zeros.
class model_memory {
 public:
  model_memory(backend::device& dev, std::size_t groups, std::size_t copy_bytes)
      : dev_(dev), groups_(groups), bytes_(copy_bytes) {
    for (std::size_t i = 0; i < 2 * groups; ++i) {
      void* host = dev.allocate_pinned_host(bytes_);
      std::memset(host, pattern(i / 2), bytes_);
      hosts_.push_back(host);
      void* target = dev.allocate_segment(bytes_);
      dev.fill({}, target, 0, bytes_);
      targets_.push_back(target);
    }
    dev.synchronize({});
  }
  ~model_memory() {
    for (void* p : targets_) dev_.free_segment(p);
    for (void* p : hosts_) dev_.free_pinned_host(p);
  }
  model_memory(const model_memory&) = delete;
  model_memory& operator=(const model_memory&) = delete;

  static std::uint8_t pattern(std::size_t group) { return static_cast<std::uint8_t>(0x21 + group); }

  std::vector<load_group> groups() const {
    std::vector<load_group> out(groups_);
    for (std::size_t i = 0; i < 2 * groups_; ++i)
      out[i / 2].copies.push_back(group_copy{targets_[i], hosts_[i], bytes_});
    return out;
  }
  /// The last byte of each of group g's destinations.
  const void* last_byte(std::size_t g, std::size_t copy) const {
    return static_cast<const std::uint8_t*>(targets_[2 * g + copy]) + bytes_ - 1;
  }

 private:
  backend::device& dev_;
  std::size_t groups_, bytes_;
  std::vector<void*> hosts_, targets_;
};

template <class Backend>
class grouped_load_test : public backend_test<Backend> {};
TYPED_TEST_SUITE(grouped_load_test, backend_types, backend_names);

/// Loads a model of growing groups on a copy stream held back at first (a
/// slow link), and runs its "layers" on a compute stream: layer g reads the
/// last byte of each of group g's copies, waiting for group g first when
/// `wait` is set. Returns how many reads saw stale bytes.
template <class Test>
int stale_reads(Test& t, bool wait) {
  auto& dev = t.device();
  constexpr std::size_t groups = 6;
  model_memory model(dev, groups, 8 * mib);
  stream copy(dev), compute(dev);
  dev.delay(copy, 50ms);
  const auto load = load_groups(dev, copy, model.groups());
  EXPECT_EQ(load.groups(), groups);
  void* seen = dev.allocate_pinned_host(2 * groups);
  for (std::size_t g = 0; g < groups; ++g) {
    if (wait) load.wait_for_group(g, compute);
    for (std::size_t c = 0; c < 2; ++c)
      dev.copy(compute, static_cast<std::uint8_t*>(seen) + 2 * g + c, model.last_byte(g, c), 1);
  }
  dev.synchronize(compute);
  load.synchronize();
  int stale = 0;
  for (std::size_t i = 0; i < 2 * groups; ++i)
    stale += static_cast<const std::uint8_t*>(seen)[i] != model_memory::pattern(i / 2);
  dev.free_pinned_host(seen);
  return stale;
}

TYPED_TEST(grouped_load_test, each_layer_waiting_for_its_group_reads_the_groups_final_bytes) {
  EXPECT_EQ(stale_reads(*this, true), 0);
}

TYPED_TEST(grouped_load_test, control_without_the_waits_layers_read_bytes_not_yet_copied) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a real data race between two streams, on purpose: not under "
                  "ThreadSanitizer";
#endif
  EXPECT_GT(stale_reads(*this, false), 0) << "the race did not show: the safe test would prove nothing";
}

TYPED_TEST(grouped_load_test, a_groups_event_covers_the_groups_before_it) {
  auto& dev = this->device();
  model_memory model(dev, 3, mib);
  stream copy(dev), compute(dev);
  const auto load = load_groups(dev, copy, model.groups());
  load.wait_for_group(2, compute);  // the last group only
  for (std::size_t g = 0; g < 3; ++g) {
    EXPECT_EQ(this->read(model.last_byte(g, 1), 1, compute)[0], model_memory::pattern(g));
  }
  EXPECT_TRUE(load.is_group_ready(0));
  EXPECT_TRUE(load.is_group_ready(2));
}

TYPED_TEST(grouped_load_test, bad_loads_are_refused_before_anything_is_enqueued) {
  auto& dev = this->device();
  model_memory model(dev, 2, 4096);
  stream copy(dev);
  EXPECT_THROW((void)load_groups(dev, copy, {}), invalid_argument);
  auto with_empty = model.groups();
  with_empty.push_back(load_group{});
  EXPECT_THROW((void)load_groups(dev, copy, with_empty), invalid_argument);
  for (auto spoil : {0, 1, 2}) {
    auto groups = model.groups();
    group_copy& c = groups[1].copies[0];
    if (spoil == 0) c.device_destination = nullptr;
    if (spoil == 1) c.host_source = nullptr;
    if (spoil == 2) c.bytes = 0;
    EXPECT_THROW((void)load_groups(dev, copy, groups), invalid_argument);
  }
  EXPECT_TRUE(dev.query(copy)) << "a refused load enqueued work";
  const auto load = load_groups(dev, copy, model.groups());
  EXPECT_THROW((void)load.group_ready(2), invalid_argument);
  EXPECT_THROW(load.wait_for_group(5, copy), invalid_argument);
}

TYPED_TEST(grouped_load_test, sources_are_held_until_the_load_is_gone_and_its_copies_have_run) {
  auto& dev = this->device();
  model_memory model(dev, 2, 4 * mib);
  stream copy(dev);
  dev.delay(copy, 20ms);
  auto groups = model.groups();
  auto owner = std::make_shared<int>(7);
  std::weak_ptr<int> watch = owner;
  groups[0].keep_alive = std::move(owner);
  {
    const auto load = load_groups(dev, copy, std::move(groups));
    EXPECT_FALSE(watch.expired()) << "a source let go of while the load exists";
  }
  EXPECT_TRUE(watch.expired());
  EXPECT_TRUE(dev.query(copy)) << "the load was destroyed before its copies ran";
  EXPECT_EQ(this->read(model.last_byte(1, 1), 1, copy)[0], model_memory::pattern(1));
}

TYPED_TEST(grouped_load_test, the_measured_copy_cost_is_a_plausible_link) {
  auto& dev = this->device();
  stream s(dev);
  const auto cost = transfer::measure_copy_cost(dev, s);
  EXPECT_GT(cost.per_group_seconds, 0);
  EXPECT_LT(cost.per_group_seconds, 1e-2) << "a group costing 10 ms is no link";
  EXPECT_GT(cost.bytes_per_second, 1e8);
  EXPECT_LT(cost.bytes_per_second, 1e13);
  EXPECT_TRUE(dev.query(s));
}

}  // namespace
}  // namespace shoal::testing
