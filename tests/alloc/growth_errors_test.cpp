// Growth that fails with a device error rather than out of memory (host
// backend: memfd_create out of descriptors, mmap past the mapping limit; CUDA:
// any other driver error): the error reaches the caller, and the allocator
// is left as it was — no reserved bytes kept for the failed growth, no pool
// lock left held — so later allocations work.
#include <gtest/gtest.h>

#include <vector>

#include <atomic>
#include <chrono>
#include <future>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/refused_allocations.h"
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

// Refuses, when told to, the nth unmap or release from now (1 = the next),
// or the next map_chunks, with an error that is not out of memory; the
// refused call changes nothing.
class refusing_device : public failing_map_device {
 public:
  using failing_map_device::failing_map_device;
  void unmap(void* address) override {
    if (unmaps_until_refusal.fetch_sub(1) == 1) throw backend_error("unmap", "refused by the test");
    failing_map_device::unmap(address);
  }
  void release_physical(backend::physical_ref chunk) override {
    if (releases_until_refusal.fetch_sub(1) == 1) throw backend_error("release_physical", "refused by the test");
    failing_map_device::release_physical(chunk);
  }
  std::atomic<int> unmaps_until_refusal{0}, releases_until_refusal{0};
};

// A give-back unmaps a free block's chunks one mapping at a time; one unmap
// failing must leave the chunks before it unmapped and accounted for, and it
// and those after it mapped and free, so nothing is lost: the next give-back
// returns every chunk.
TEST(growth_errors, an_unmap_failing_midway_loses_no_chunk_and_leaves_the_rest_mapped) {
  refusing_device dev(backend::host_device_instance());
  {
    alloc::caching_allocator a(dev, expandable());
    void* p[3];
    for (auto& q : p) q = a.allocate(24 * mib, {});  // three mappings of one chunk each
    for (auto* q : p) a.deallocate(q, {});
    ASSERT_EQ(dev.live_chunks(), 3);
    dev.unmaps_until_refusal = 1;  // the first: nothing was unmapped
    EXPECT_THROW(a.empty_cache(), backend_error);
    EXPECT_NO_THROW(a.check_invariants()) << "the free block left out of its bins";
    EXPECT_EQ(dev.live_chunks(), 3);
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(72 * mib));
    dev.unmaps_until_refusal = 2;
    EXPECT_THROW(a.empty_cache(), backend_error);
    EXPECT_NO_THROW(a.check_invariants()) << "the free block left out of its bins, or its mappings misrecorded";
    EXPECT_EQ(dev.live_chunks(), 2) << "the first chunk went back, the other two are still mapped";
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(48 * mib));
    void* again = a.allocate(48 * mib, {});  // the two mapped chunks serve it with no growth
    EXPECT_EQ(dev.creates, 3) << "the chunks still mapped were used again";
    a.deallocate(again, {});
    a.empty_cache();
    EXPECT_EQ(dev.live_chunks(), 0) << "a chunk's record was lost with its failed unmap";
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
  }
  EXPECT_EQ(dev.live_chunks(), 0);
}

// A growth whose mapping fails releases the chunks it made for it; one of
// those releases failing must not keep the others from going back.
TEST(growth_errors, a_release_failing_after_a_failed_mapping_does_not_keep_the_other_chunks) {
  refusing_device dev(backend::host_device_instance());
  {
    alloc::caching_allocator a(dev, expandable());
    dev.fail_next_map = true;
    dev.releases_until_refusal = 1;
    EXPECT_THROW((void)a.allocate(300 * mib, {}), backend_error);  // chunks of 128, 128 and 44 MiB made, none mapped
    EXPECT_EQ(dev.creates, 3);
    EXPECT_EQ(dev.live_chunks(), 1) << "only the chunk whose release was refused is left";
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
    EXPECT_NO_THROW(a.check_invariants());
    void* p = a.allocate(300 * mib, {});
    a.deallocate(p, {});
  }
  EXPECT_EQ(dev.live_chunks(), 1);
}

// A cached plain segment whose free fails stays cached as it was (in its
// bins and in the directory), so a later give-back returns it.
TEST(growth_errors, a_segment_whose_free_fails_stays_cached_and_goes_back_later) {
  struct device : forwarding_device {
    using forwarding_device::forwarding_device;
    void free_segment(void* ptr) override {
      if (refuse_free.exchange(false)) throw backend_error("free_segment", "refused by the test");
      forwarding_device::free_segment(ptr);
    }
    std::atomic<bool> refuse_free{false};
  } dev(backend::host_device_instance());
  alloc::caching_allocator a(dev, alloc::allocator_config{});
  std::vector<alloc::trace_action> told;  // segment events
  std::int64_t held = 0;                  // bytes they say the allocator holds
  (void)a.add_segment_observer([&](const alloc::segment_event& e) {
    told.push_back(e.action);
    held += e.action == alloc::trace_action::segment_alloc ? static_cast<std::int64_t>(e.size)
                                                           : -static_cast<std::int64_t>(e.size);
  });
  void* p = a.allocate(4 * mib, {});
  a.deallocate(p, {});
  const auto reserved = a.stats().reserved_bytes.aggregate.current;
  ASSERT_GT(reserved, 0);
  dev.refuse_free = true;
  EXPECT_THROW(a.empty_cache(), backend_error);
  EXPECT_NO_THROW(a.check_invariants()) << "the segment's free block left out of its bins or the directory";
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, reserved);
  using enum alloc::trace_action;
  EXPECT_EQ(told, (std::vector{segment_alloc, segment_free, segment_alloc})) << "told given back, then taken again";
  EXPECT_EQ(held, reserved) << "the observers' count agrees: the segment stayed";
  void* again = a.allocate(4 * mib, {});
  EXPECT_EQ(again, p) << "the cached segment serves the request again";
  a.deallocate(again, {});
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
  EXPECT_EQ(a.stats().segments.aggregate.current, 0);
}

// The VMM counters count calls, a failed one included (it cost the driver's
// time); creates count chunks made.
TEST(growth_errors, failed_maps_and_unmaps_are_counted) {
  refusing_device dev(backend::host_device_instance());
  alloc::caching_allocator a(dev, expandable());
  dev.fail_next_map = true;
  EXPECT_THROW((void)a.allocate(24 * mib, {}), backend_error);
  auto calls = a.stats().vmm_calls;
  EXPECT_EQ(calls.maps, 1) << "the failed map";
  EXPECT_EQ(calls.access_grants, 1);
  EXPECT_EQ(calls.creates, 1);
  EXPECT_EQ(calls.releases, 1);
  a.deallocate(a.allocate(24 * mib, {}), {});
  dev.unmaps_until_refusal = 1;
  EXPECT_THROW(a.empty_cache(), backend_error);
  EXPECT_EQ(a.stats().vmm_calls.unmaps, 1) << "the failed unmap";
  a.empty_cache();
  calls = a.stats().vmm_calls;
  EXPECT_EQ(calls.unmaps, 2);
  EXPECT_EQ(calls.maps, 2);
}

// A release observer that throws while memory is given back (plain segments
// and growable chunks alike): nothing went back, and the free memory stays
// cached in its bins, so a later give-back returns it.
TEST(growth_errors, an_observer_throwing_during_a_give_back_leaves_the_memory_cached) {
  for (const char* conf : {"", "expandable_segments:true"}) {
    SCOPED_TRACE(conf);
    vmm_counting_device dev(backend::host_device_instance());
    alloc::caching_allocator a(dev, alloc::allocator_config::parse(conf));
    void* p = a.allocate(4 * mib, {});
    a.deallocate(p, {});
    const auto reserved = a.stats().reserved_bytes.aggregate.current;
    std::atomic<bool> refuse{true};
    const auto id = a.add_release_observer([&](std::uintptr_t, std::size_t) {
      if (refuse.exchange(false)) throw std::runtime_error("an observer that fails");
    });
    EXPECT_THROW(a.empty_cache(), std::runtime_error);
    EXPECT_NO_THROW(a.check_invariants()) << "the free block left out of its bins";
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, reserved);
    a.empty_cache();
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
    EXPECT_EQ(dev.live_chunks(), 0);
    a.remove_hook(id);
  }
}

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

// A first allocation (its pools, its segment's bookkeeping, its hand-out)
// refused host memory at each of its heap allocations in turn, every later
// one refused too: std::bad_alloc, and every byte the device gave is the
// allocator's, counted as reserved (a stranded segment would be neither),
// and goes back with the cache.
void refuse_each_allocation_of_a_first_growth(const alloc::allocator_config& config) {
  int refusals = 0;
  for (int nth = 1; nth < 200; ++nth) {
    SCOPED_TRACE("the growth's heap allocation " + std::to_string(nth) + " refused");
    backend::host_device dev({.capacity_bytes = 64 * mib});
    alloc::caching_allocator a(dev, config);
    const auto free_before = dev.memory().free_bytes;
    bool refused = false;
    bool threw = false;
    void* p = nullptr;
    {
      std::optional<refusing_allocations> all_after;
      const refusing_one_allocation refuse(nth, [&] { all_after.emplace(); });
      try {
        p = a.allocate(mib, {});
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      refused = refuse.refused();
    }
    if (!refused) {
      a.deallocate(p, {});
      break;
    }
    ++refusals;
    EXPECT_NO_THROW(a.check_invariants());
    if (threw) {  // a segment made before the refusal stays cached, counted as reserved
      const auto reserved = static_cast<std::size_t>(a.stats().reserved_bytes.aggregate.current);
      EXPECT_EQ(dev.memory().free_bytes + reserved, free_before) << "a segment the device gave was stranded";
    } else {
      a.deallocate(p, {});  // the refusal came after the growth (an invariant check, skipped)
    }
    a.empty_cache();
    EXPECT_EQ(dev.memory().free_bytes, free_before) << "a segment did not go back";
  }
  EXPECT_GT(refusals, 0) << "the growth allocated nothing: the test no longer reaches what it names";
}

TEST(growth_errors, a_growth_refused_host_memory_strands_no_segment) {
  refuse_each_allocation_of_a_first_growth(alloc::allocator_config{});
}

TEST(growth_errors, a_growable_segment_s_growth_refused_host_memory_strands_no_chunk) {
  refuse_each_allocation_of_a_first_growth(expandable());
}

// A growth past the peak unmaps free whole chunks to map them again where
// the request goes; refused host memory at each of its heap allocations in
// turn (every later one too), it keeps no chunk unmapped: the physical
// memory held is the memory mapped, and all of it goes back with the cache.
TEST(growth_errors, a_growth_past_the_peak_refused_host_memory_keeps_no_unmapped_chunk) {
  int refusals = 0;
  for (int nth = 1; nth < 200; ++nth) {
    SCOPED_TRACE("the growth's heap allocation " + std::to_string(nth) + " refused");
    backend::host_device dev({.capacity_bytes = 256 * mib});
    const auto free_before = dev.memory().free_bytes;
    alloc::caching_allocator a(dev, expandable());
    void* first = a.allocate(30 * mib, {});
    void* second = a.allocate(30 * mib, {});
    a.deallocate(first, {});  // 30 MiB of free chunks before `second`: too few for 40
    bool refused = false;
    void* p = nullptr;
    {
      std::optional<refusing_allocations> all_after;
      const refusing_one_allocation refuse(nth, [&] { all_after.emplace(); });
      try {
        p = a.allocate(40 * mib, {});
      } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): what the test brings about
      }
      refused = refuse.refused();
    }
    if (p != nullptr) a.deallocate(p, {});
    if (!refused) break;
    ++refusals;
    EXPECT_NO_THROW(a.check_invariants());
    a.deallocate(second, {});
    a.empty_cache();
    EXPECT_EQ(dev.memory().free_bytes, free_before) << "a chunk was kept unmapped";
  }
  EXPECT_GT(refusals, 0) << "the growth allocated nothing: the test no longer reaches what it names";
}

// Giving back free whole chunks splits the free block around them (a mapped
// head, the hole, a mapped tail): refused host memory at each heap
// allocation of an empty_cache in turn (every later one too), the blocks
// stay whole and true to the mappings. The split's block objects are taken
// before anything is unmapped; taken after, a refusal left a free block
// marked mapped over unmapped chunks, out of the bins.
TEST(growth_errors, a_give_back_refused_host_memory_leaves_the_blocks_true_to_the_mappings) {
  int refusals = 0;
  for (int nth = 1; nth < 200; ++nth) {
    SCOPED_TRACE("the give-back's heap allocation " + std::to_string(nth) + " refused");
    refusing_device dev(backend::host_device_instance());
    {
      alloc::caching_allocator a(dev, expandable());
      // Groups of three 4 MiB mappings A, B, C, each ending as a free block
      // [A + 2 MiB, C + 2 MiB): B whole inside, A's and C's halves beside it.
      constexpr int groups = 8;
      std::vector<void*> whole(3 * groups), kept;
      for (auto& p : whole) p = a.allocate(4 * mib, {});  // one mapping each
      std::vector<void*> freed_later;
      for (int i = 0; i < groups; ++i) {
        a.deallocate(whole[3 * i], {});
        kept.push_back(a.allocate(2 * mib, {}));         // A's first half
        freed_later.push_back(a.allocate(2 * mib, {}));  // A's second half
        a.deallocate(whole[3 * i + 2], {});
        freed_later.push_back(a.allocate(2 * mib, {}));  // C's first half
        kept.push_back(a.allocate(2 * mib, {}));         // C's second half
      }
      ASSERT_EQ(dev.creates, 3 * groups);
      for (void* p : freed_later) a.deallocate(p, {});
      for (int i = 0; i < groups; ++i) a.deallocate(whole[3 * i + 1], {});
      a.deallocate(a.allocate(200 * mib, {}), {});  // settles the parked frees
      // Each of these splits a free block: the pool's spare block objects are
      // used up, so the give-back's splits must make new ones.
      for (int i = 0; i < 20; ++i) kept.push_back(a.allocate(9 * mib, {}));
      bool refused = false;
      {
        std::optional<refusing_allocations> all_after;
        const refusing_one_allocation refuse(nth, [&] { all_after.emplace(); });
        try {
          a.empty_cache();
        } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): what the test brings about
        }
        refused = refuse.refused();
      }
      EXPECT_NO_THROW(a.check_invariants());
      for (void* p : kept) a.deallocate(p, {});
      a.empty_cache();
      EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
      if (!refused) break;
      ++refusals;
    }
    EXPECT_EQ(dev.live_chunks(), 0) << "a chunk was kept";
    if (HasFailure()) break;
  }
  EXPECT_GT(refusals, 0) << "the give-back allocated nothing: the test no longer reaches what it names";
}

}  // namespace
}  // namespace shoal::testing
