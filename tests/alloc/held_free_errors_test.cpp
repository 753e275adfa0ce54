// A free that holds its block (it waits for streams or events) refused host
// memory at each of its heap allocations in turn: it throws std::bad_alloc
// and the block stays allocated, counted as before, so the owner's next free
// of it works, exactly once, and nothing is lost.
#include <gtest/gtest.h>

#include <functional>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

struct held_free {
  const char* conf;
  bool awaits;  // pinned host frees on their own stream (awaiting_frees.h)
  // Frees p (allocated on the default stream) the held way; `others` are
  // streams other than p's.
  std::function<void(alloc::caching_allocator&, void*, const std::vector<backend::stream>& others)> free;
};

// `held_before`: held frees still pending when the refused one comes (63
// fills the pending list's first 64-entry node, so the next needs a new one).
void refuse_each_allocation_of(const held_free& how, int held_before) {
  int refusals = 0;
  for (int nth = 1; nth < 200; ++nth) {
    SCOPED_TRACE(std::to_string(held_before) + " held before, the free's heap allocation " + std::to_string(nth) +
                 " refused");
    backend::host_device dev({.capacity_bytes = 64 * mib});
    alloc::caching_allocator a(dev, alloc::allocator_config::parse(how.conf));
    std::vector<backend::stream> others;
    for (int i = 0; i < 3; ++i) others.emplace_back(dev);
    std::vector<void*> held(static_cast<std::size_t>(held_before));
    for (auto& h : held) h = a.allocate(512);
    for (void* h : held) how.free(a, h, others);

    void* p = a.allocate(512);
    const auto before = a.stats();
    bool refused = false;
    bool threw = false;
    {
      // From the nth allocation on, every one is refused: what undoes a
      // refused step must not need memory either.
      std::optional<refusing_allocations> all_after;
      const refusing_one_allocation refuse(nth, [&] { all_after.emplace(); });
      try {
        how.free(a, p, others);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      refused = refuse.refused();
    }
    EXPECT_NO_THROW(a.check_invariants());
    if (!refused) {  // the free made fewer allocations: every one was refused in turn
      EXPECT_THROW(a.deallocate(p), invalid_argument) << "freed once already";
      break;
    }
    ++refusals;
    // Not thrown: the refusal came after the free and was absorbed (a pinned
    // group's seal, left for the next; or, in builds that check invariants
    // after every step, that check, skipped): the free happened.
    if (threw) {  // nothing happened: the block is still allocated, counted as before
      const auto after = a.stats();
      EXPECT_EQ(after.allocations.aggregate.current, before.allocations.aggregate.current) << after.to_json();
      EXPECT_EQ(after.requested_bytes.aggregate.current, before.requested_bytes.aggregate.current) << after.to_json();
      EXPECT_NO_THROW(a.deallocate(p)) << "the refused free left the block allocated";
    }
    EXPECT_THROW(a.deallocate(p), invalid_argument) << "freed twice";
    dev.synchronize_device();
    a.empty_cache();
    EXPECT_NO_THROW(a.check_invariants()) << "every block is in its list (none lost)";
    EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
    if (!how.awaits) {  // pinned frees on their stream stay held until the stream's next call seals them
      EXPECT_TRUE(nothing_in_use(a.stats()));
      EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "memory was lost";
    }
  }
  EXPECT_GT(refusals, 0) << "the free allocated nothing: the test no longer reaches what it names";
}

TEST(held_free_errors, a_free_after_record_stream_refused_memory_keeps_its_block) {
  const held_free how{"", false, [](alloc::caching_allocator& a, void* p, const std::vector<backend::stream>& others) {
                        a.record_stream(p, others[0]);
                        a.deallocate(p);
                      }};
  refuse_each_allocation_of(how, 0);
  refuse_each_allocation_of(how, 63);
}

TEST(held_free_errors, a_free_on_another_stream_refused_memory_keeps_its_block) {
  const held_free how{"", false, [](alloc::caching_allocator& a, void* p, const std::vector<backend::stream>& others) {
                        a.deallocate(p, others[0]);
                      }};
  refuse_each_allocation_of(how, 0);
  refuse_each_allocation_of(how, 63);
}

TEST(held_free_errors, a_free_that_records_three_events_refused_memory_keeps_its_block) {
  // Events made one by one: a refusal after the first was recorded gives
  // the recorded ones back (without allocating).
  const held_free how{"", false, [](alloc::caching_allocator& a, void* p, const std::vector<backend::stream>& others) {
                        a.record_stream(p, others[0]);
                        a.record_stream(p, others[1]);
                        a.deallocate(p, others[2]);
                      }};
  refuse_each_allocation_of(how, 0);
  refuse_each_allocation_of(how, 63);
}

TEST(held_free_errors, a_pinned_host_free_refused_memory_keeps_its_block) {
  const held_free how{"memory:pinned_host", true, [](alloc::caching_allocator& a, void* p, const std::vector<backend::stream>&) {
                        a.deallocate(p);
                      }};
  refuse_each_allocation_of(how, 0);
  refuse_each_allocation_of(how, 63);
}

TEST(held_free_errors, a_debug_free_that_marks_a_hazard_refused_memory_keeps_its_block) {
  // Not held (cross-stream safety off), but poisoned and settled at once,
  // with the hazard's event in its waits.
  const held_free how{"debug:true,cross_stream_safety:false", false,
                      [](alloc::caching_allocator& a, void* p, const std::vector<backend::stream>& others) {
                        a.deallocate(p, others[0]);
                      }};
  refuse_each_allocation_of(how, 0);
  refuse_each_allocation_of(how, 63);
}

// Debug mode with cross-stream safety off: a block freed on another stream
// settles at once carrying its hazard event; freeing its neighbour the same
// way merges both events into one block, and the room for that merge is
// taken (after the neighbour's own event is recorded) before anything counts.
TEST(held_free_errors, a_debug_hazard_free_next_to_one_refused_memory_keeps_its_block) {
  int refusals = 0;
  for (int nth = 1; nth < 100; ++nth) {
    SCOPED_TRACE("the free's heap allocation " + std::to_string(nth) + " refused");
    backend::host_device dev({.capacity_bytes = 64 * mib});
    alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true,cross_stream_safety:false"));
    backend::stream other(dev);
    void* first = a.allocate(512);
    void* second = a.allocate(512);  // right after `first` in the segment
    void* after = a.allocate(512);   // keeps `second` from merging with the segment's rest
    a.deallocate(first, other);      // settled, one hazard event in its waits
    bool refused = false;
    bool threw = false;
    {
      std::optional<refusing_allocations> all_after;
      const refusing_one_allocation refuse(nth, [&] { all_after.emplace(); });
      try {
        a.deallocate(second, other);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      refused = refuse.refused();
    }
    EXPECT_NO_THROW(a.check_invariants());
    if (!refused) break;
    ++refusals;
    if (threw) EXPECT_NO_THROW(a.deallocate(second, other)) << "the refused free left the block allocated";
    EXPECT_THROW(a.deallocate(second, other), invalid_argument) << "freed twice";
    a.deallocate(after);
    dev.synchronize_device();
    a.empty_cache();
    EXPECT_NO_THROW(a.check_invariants());
    EXPECT_TRUE(nothing_in_use(a.stats()));
  }
  EXPECT_GT(refusals, 0) << "the free allocated nothing: the test no longer reaches what it names";
}

// Collecting pending frees refused host memory midway (debug mode poisons
// each block as it becomes reusable, which allocates on the host backend):
// the blocks made reusable before the refusal leave the pending list, the
// rest stay in it, and none is in both.
TEST(held_free_errors, collecting_pending_frees_refused_memory_midway_keeps_each_block_in_one_place) {
  int refusals = 0;
  for (int nth = 1; nth < 100; ++nth) {
    SCOPED_TRACE("the collection's heap allocation " + std::to_string(nth) + " refused");
    backend::host_device dev({.capacity_bytes = 64 * mib});
    alloc::caching_allocator a(dev, alloc::allocator_config::parse("debug:true"));
    backend::stream other(dev);
    std::vector<void*> blocks;
    for (int i = 0; i < 4; ++i) blocks.push_back(a.allocate(512));
    for (void* p : blocks) a.deallocate(p, other);  // pending, for `other`
    dev.synchronize_device();
    bool refused = false;
    {
      std::optional<refusing_allocations> all_after;
      const refusing_one_allocation refuse(nth, [&] { all_after.emplace(); });
      try {
        a.process_pending_frees();
      } catch (const std::bad_alloc&) {
      }
      refused = refuse.refused();
    }
    EXPECT_NO_THROW(a.check_invariants()) << "a block both reusable and pending";
    if (!refused) break;
    ++refusals;
    dev.synchronize_device();
    a.empty_cache();
    EXPECT_NO_THROW(a.check_invariants());
    EXPECT_TRUE(nothing_in_use(a.stats()));
    EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0) << "memory was lost";
  }
  EXPECT_GT(refusals, 1) << "the collection stopped at its first block only: the test no longer reaches what it names";
}

}  // namespace
}  // namespace shoal::testing
