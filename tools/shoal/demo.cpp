// `shoal demo`: the product in five steps on the default device. Each step
// lives in its own file (demo_streams.cpp, demo_lazy_clone.cpp,
// demo_sharing.cpp); this one runs them and reports the allocator at the end.
#include "tools/shoal/demo.h"

#include <cstdio>

#include "shoal/backend/devices.h"
#include "tools/shoal/demo_steps.h"

namespace shoal::tools {

namespace demo {

void show_stats(const alloc::caching_allocator& allocator) {
  const alloc::allocator_stats s = allocator.stats();
  const auto& allocated = s.allocated_bytes.aggregate;
  const auto& reserved = s.reserved_bytes.aggregate;
  const std::int64_t handed_out = s.allocations.aggregate.allocated;
  // Without expandable segments, every device allocation served one hand-out;
  // every other hand-out came from the cache.
  const std::int64_t from_cache = handed_out - s.device_allocations;
  std::printf("[stats] allocated now %s (peak %s); reserved now %s (peak %s) in %lld segment(s)\n",
              mib(allocated.current).c_str(), mib(allocated.peak).c_str(), mib(reserved.current).c_str(),
              mib(reserved.peak).c_str(), static_cast<long long>(s.segments.aggregate.current));
  std::printf("[stats] %lld blocks handed out, %lld from the cache without a device call; %lld device allocations, "
              "%lld device frees, %lld retries, %lld out-of-memory\n",
              static_cast<long long>(handed_out), static_cast<long long>(from_cache),
              static_cast<long long>(s.device_allocations), static_cast<long long>(s.device_frees),
              static_cast<long long>(s.retries), static_cast<long long>(s.ooms));
  expect(allocated.current == 0, "the allocator still holds " + mib(allocated.current) + " allocated at the end: a leak");
  expect(from_cache > 0, "no hand-out came from the cache");
}

}  // namespace demo

int run_demo() {
  backend::device& dev = backend::default_device();
  const auto mem = dev.memory();
  std::printf("[device] %s:%d  %s  (%.1f of %.1f GiB free)\n", std::string(to_string(dev.kind())).c_str(),
              dev.ordinal(), dev.name().c_str(), mem.free_bytes / 1073741824.0, mem.total_bytes / 1073741824.0);
  // The streams outlive the allocator; the allocator's settings are the
  // defaults whatever SHOAL_ALLOC_CONF says, since the demo checks them.
  demo::demo_streams streams{backend::stream(dev), backend::stream(dev)};
  alloc::caching_allocator allocator(dev, alloc::allocator_config{});
  demo::settle_streams settle{streams};
  demo::show_streams(dev, allocator, streams);
  demo::show_lazy_clone(dev, allocator);
  demo::show_sharing(dev, allocator);
  demo::show_stats(allocator);
  std::printf("demo: every step checked out\n");
  return 0;
}

}  // namespace shoal::tools
