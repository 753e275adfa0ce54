// caching_allocator::check_invariants: a correct allocator passes it after
// every step of a random walk, and each invariant broken on purpose (through
// the test hook) is caught and named, with the segment and block it is in.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shoal/alloc/invariant_test_hook.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"
#include "support/sanitized.h"

namespace shoal::testing {
namespace {

using alloc::test_hook::invariant_breakage;
constexpr std::size_t kib = 1024, mib = kib * kib;

std::string hex(const void* p) {
  std::ostringstream out;
  out << "0x" << std::hex << reinterpret_cast<std::uintptr_t>(p);
  return out.str();
}

const void* offset(const void* p, std::size_t bytes) { return static_cast<const std::uint8_t*>(p) + bytes; }

template <class Param>
using invariant_checker = allocator_test<Param>;
TYPED_TEST_SUITE(invariant_checker, backend_config_types, backend_config_names);

TYPED_TEST(invariant_checker, a_correct_allocator_passes_after_every_step_of_a_random_walk) {
  auto& dev = this->device();
  auto& a = this->make();
  constexpr std::size_t region_bytes = 8 * mib;
  void* region = dev.allocate_segment(region_bytes);
  const auto pool = a.create_private_pool(region, region_bytes, {{"params", 4 * mib}, {"work", 4 * mib}});
  std::vector<backend::stream> streams;
  for (int i = 0; i < 3; ++i) streams.emplace_back(dev);
  std::vector<backend::stream_ref> on = {backend::stream_ref{}};
  for (auto& s : streams) on.push_back(s);
  struct live {
    void* ptr;
    backend::stream_ref stream;
    bool from_work = false;  ///< allocated in the "work" sub-pool
    bool taken = false;      ///< taken back by a forced clear: only its free is left
  };
  std::vector<live> blocks;
  std::mt19937 random(17);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(random() % n); };
  // Sanitized builds: a quarter of the steps (there the allocator also
  // checks its invariants inside every operation: 12-32 s under TSan for
  // 3000). 750 steps still take every kind of step, forced clears (1 in
  // 100) among them, with over a hundred blocks live at once.
  const int steps = fewer_when_sanitized(this->on_host ? 3000 : 1000, 4);
  for (int step = 0; step < steps; ++step) {
    const unsigned choice = random() % 100;
    if (choice < 45 || blocks.empty()) {
      const std::size_t bytes = choice % 5 == 0 ? 1 + pick(24 * mib) : 1 + pick(256 * kib);
      const backend::stream_ref s = on[pick(on.size())];
      blocks.push_back({a.allocate(bytes, s), s});
    } else if (choice < 49) {  // from a private sub-pool, which may be full
      const bool work = choice % 2 == 1;
      alloc::private_pool_scope scope(a, pool, work ? "work" : "params");
      const backend::stream_ref s = on[pick(on.size())];
      try {
        blocks.push_back({a.allocate(1 + pick(512 * kib), s), s, work});
      } catch (const out_of_memory&) {  // NOLINT(bugprone-empty-catch): private pools never grow
      }
    } else if (choice < 50) {  // a forced clear: the work sub-pool's blocks leave tombstones
      (void)a.clear_private_pool(pool, "work", alloc::live_blocks::invalidate);
      for (auto& b : blocks) b.taken = b.taken || b.from_work;
    } else if (choice < 80) {  // free on the block's stream, or on another one
      const std::size_t i = pick(blocks.size());
      a.deallocate(blocks[i].ptr, choice < 70 ? blocks[i].stream : on[pick(on.size())]);
      blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (choice < 90) {
      const live& b = blocks[pick(blocks.size())];
      if (!b.taken) a.record_stream(b.ptr, on[pick(on.size())]);
    } else if (choice < 97) {
      a.process_pending_frees();
    } else {
      a.empty_cache();
    }
    try {
      a.check_invariants();
    } catch (const invariant_violation& e) {
      FAIL() << "after step " << step << ": " << e.what();
    }
  }
  for (const auto& b : blocks) a.deallocate(b.ptr, b.stream);
  a.empty_cache();
  for (auto s : on) dev.synchronize(s);  // debug mode's poison fills may still be queued on the region
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_TRUE(nothing_in_use(a.stats()));
  a.destroy_private_pool(pool);
  EXPECT_NO_THROW(a.check_invariants());
  dev.free_segment(region);
}

// Breaks `what` around a 512-byte block allocated first on the default
// stream: it starts its segment (or growable range), and the rest of the
// segment (or of its first chunk) is one settled free block after it.
template <class Test>
alloc::caching_allocator& broken(Test& test, invariant_breakage what, void*& block) {
  auto& a = test.make();
  block = a.allocate(512, {});
  EXPECT_NO_THROW(a.check_invariants()) << "sound before it is broken";
  alloc::test_hook::unsafe_break_invariant(a, block, what);
  return a;
}

// The invariant_violation check_invariants throws (fails the test if none).
invariant_violation caught(const alloc::caching_allocator& a) {
  try {
    a.check_invariants();
  } catch (const invariant_violation& e) {
    return e;
  }
  ADD_FAILURE() << "check_invariants passed a broken allocator";
  return invariant_violation("none", "none");
}

TYPED_TEST(invariant_checker, a_tombstone_missing_from_its_pool_s_index_breaks_states) {
  auto& dev = this->device();
  auto& a = this->make();
  void* region = dev.allocate_segment(2 * mib);
  const auto pool = a.create_private_pool(region, 2 * mib);
  void* stale = nullptr;
  {
    alloc::private_pool_scope scope(a, pool);
    stale = a.allocate(mib, {});
  }
  (void)a.clear_private_pool(pool, "", alloc::live_blocks::invalidate);
  EXPECT_NO_THROW(a.check_invariants()) << "a tombstone is sound bookkeeping";
  alloc::test_hook::unsafe_break_invariant(a, stale, invariant_breakage::tombstone_unindexed);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "states") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("block " + hex(stale)), std::string::npos) << what;
  EXPECT_NE(what.find("invalidated"), std::string::npos) << what;
  dev.synchronize_device();  // debug poison
  dev.free_segment(region);  // the allocator is broken: its pool is left as it is
}

TYPED_TEST(invariant_checker, a_block_overlapping_its_neighbour_breaks_tiling) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::block_overlap, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "tiling") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("segment " + hex(block)), std::string::npos) << what;
  EXPECT_NE(what.find("block " + hex(block)), std::string::npos) << what;
  EXPECT_NE(what.find("overlap"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_settled_free_block_missing_from_the_bins_breaks_bin_membership) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::settled_not_in_bins, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "free bins") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("block " + hex(offset(block, 512))), std::string::npos) << what;
  EXPECT_NE(what.find("segment " + hex(block)), std::string::npos) << what;
  EXPECT_NE(what.find("not in the free bins"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_free_block_still_holding_a_recorded_stream_breaks_states) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::free_block_holds_a_recorded_stream, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "states") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("block " + hex(offset(block, 512))), std::string::npos) << what;
  EXPECT_NE(what.find("still holds streams recorded on it"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, two_neighbouring_settled_free_blocks_are_caught) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::free_neighbours, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "neighbours") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("block " + hex(offset(block, 512))), std::string::npos) << what;
  EXPECT_NE(what.find("block " + hex(offset(block, 1024))), std::string::npos) << what;
  EXPECT_NE(what.find("segment " + hex(block)), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_counter_off_from_its_blocks_is_caught) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::counter, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "counters") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("allocated_bytes = 1024 but its blocks sum to 512"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_segment_missing_from_the_directory_is_caught) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::unregistered, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "directory") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("segment " + hex(block)), std::string::npos) << what;
  EXPECT_NE(what.find("missing from the segment directory"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_segment_without_its_number_is_caught) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::unnumbered, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "numbers") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("segment " + hex(block)), std::string::npos) << what;
  EXPECT_NE(what.find("number 0 (none)"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_segment_numbered_as_an_earlier_one_is_caught) {
  auto& a = this->make("expandable_segments:false");  // a second segment in the same pool
  [[maybe_unused]] void* first = a.allocate(mib, {});
  [[maybe_unused]] void* second = a.allocate(mib, {});
  void* third = a.allocate(mib, {});  // the small pool's 2 MiB segment is full: a second one
  EXPECT_NO_THROW(a.check_invariants()) << "sound before it is broken";
  alloc::test_hook::unsafe_break_invariant(a, third, invariant_breakage::numbered_as_first);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "numbers") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("segment " + hex(third)), std::string::npos) << what;
  EXPECT_NE(what.find("the same as another's"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_pool_in_the_directory_but_out_of_service_is_caught) {
  void* block = nullptr;
  auto& a = broken(*this, invariant_breakage::out_of_service, block);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "directory") << e.what();
  const std::string what = e.what();
  EXPECT_NE(what.find("out of service"), std::string::npos) << what;
}

TYPED_TEST(invariant_checker, a_vacant_pool_without_its_mark_is_caught) {
  auto& dev = this->device();
  auto& a = this->make();
  backend::stream next(dev);
  void* p = a.allocate(kib, next);
  {
    backend::stream gone(dev);
    a.deallocate(a.allocate(mib, gone), gone);
    dev.synchronize(gone);
  }
  a.empty_cache();  // lets `gone` go: its pools are vacant
  EXPECT_NO_THROW(a.check_invariants());
  alloc::test_hook::unsafe_break_invariant(a, p, invariant_breakage::vacant_unmarked);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "vacant") << e.what();
  dev.synchronize(next);  // the allocator is broken: `p` is left as it is (a free would check it again)
}

// A vacant pool keeps the blocks its stream parked (the next new stream
// takes them as they are), and nothing else: a block handed out there is
// caught, though the pool's own books stay consistent.
TYPED_TEST(invariant_checker, a_vacant_pool_holding_a_handed_out_block_is_caught) {
  auto& dev = this->device();
  auto& a = this->make();
  if (a.config().debug) GTEST_SKIP() << "debug mode parks no freed block";
  backend::stream next(dev);
  void* p = a.allocate(kib, next);
  {
    backend::stream gone(dev);
    a.deallocate(a.allocate(mib, gone), gone);  // parked
    dev.synchronize(gone);
  }
  a.deallocate(a.allocate(kib, next), next);  // the sweep lets `gone` go, its parked block kept
  EXPECT_NO_THROW(a.check_invariants());
  alloc::test_hook::unsafe_break_invariant(a, p, invariant_breakage::vacant_block_handed_out);
  const auto e = caught(a);
  EXPECT_EQ(e.invariant(), "vacant") << e.what();
  dev.synchronize(next);  // the allocator is broken: `p` is left as it is (a free would check it again)
}

TYPED_TEST(invariant_checker, the_hook_refuses_a_pointer_the_allocator_did_not_hand_out) {
  auto& a = this->make();
  int local = 0;
  EXPECT_THROW(alloc::test_hook::unsafe_break_invariant(a, &local, invariant_breakage::counter), invalid_argument);
  EXPECT_NO_THROW(a.check_invariants());
}

}  // namespace
}  // namespace shoal::testing
