// Sizes, pools, reuse, splitting, statistics and bad input, on every backend
// under every allocator configuration (default, expandable_segments, debug).
// Tests about the layout of fixed segments run without expandable_segments.
#include <gtest/gtest.h>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/allocators.h"

namespace shoal::testing {
namespace {

using alloc::block_state;
using alloc::pool_kind;
constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Backend>
using allocator_basic = allocator_test<Backend>;
TYPED_TEST_SUITE(allocator_basic, backend_config_types, backend_config_names);

// The layout of fixed segments (2, 20 and 26 MiB; splitting and statistics in
// their terms): every configuration but expandable_segments, where each pool
// grows one reserved range by 2 MiB chunks instead.
template <class Backend>
using allocator_fixed_segments = allocator_test<Backend>;
TYPED_TEST_SUITE(allocator_fixed_segments, fixed_segment_config_types, backend_config_names);

TYPED_TEST(allocator_basic, sizes_round_to_512_or_to_power_of_two_divisions) {
  auto& a = this->make("roundup_power2_divisions:[1:1,>:4]");
  void* p = a.allocate(1, {});
  void* q = a.allocate(513, {});
  void* r = a.allocate(1200 * kib, {});  // (1 MiB, 2 MiB] in 4 steps of 256 KiB
  EXPECT_EQ(a.block_size(p), 512u);
  EXPECT_EQ(a.block_size(q), 1024u);
  // A growable range maps 2 MiB chunks: the 768 KiB left of r's chunk is
  // too small to split off a large block, so r's block is the whole chunk.
  if (!this->expandable_segments) EXPECT_EQ(a.block_size(r), 1280 * kib);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(q) % 512, 0u);
  for (void* x : {p, q, r}) a.deallocate(x, {});
}

TYPED_TEST(allocator_fixed_segments, small_and_large_pools_take_their_segment_sizes) {
  auto& a = this->make();
  void* small = a.allocate(mib, {});
  void* mid = a.allocate(mib + 1, {});
  void* big = a.allocate(25 * mib, {});  // more than the 20 MiB segment has left
  const auto snap = a.take_snapshot();
  std::map<std::size_t, pool_kind> segments;
  for (const auto& s : snap.segments) segments[s.size] = s.pool;
  EXPECT_EQ(segments.size(), 3u);
  EXPECT_EQ(segments.at(2 * mib), pool_kind::small);
  EXPECT_EQ(segments.at(20 * mib), pool_kind::large);
  EXPECT_EQ(segments.at(26 * mib), pool_kind::large) << "25 MiB rounds to a 26 MiB segment";
  const auto st = a.stats();
  EXPECT_EQ(st.segments.pool[0].current, 1);
  EXPECT_EQ(st.segments.pool[1].current, 2);
  EXPECT_EQ(st.reserved_bytes.aggregate.current, static_cast<std::int64_t>(48 * mib));
  for (void* x : {small, mid, big}) a.deallocate(x, {});
}

TYPED_TEST(allocator_basic, a_freed_block_is_reused_on_its_stream_without_the_device) {
  auto& a = this->make();
  void* p = a.allocate(64 * kib, {});
  a.deallocate(p, {});
  void* q = a.allocate(64 * kib, {});
  EXPECT_EQ(p, q);
  EXPECT_EQ(a.stats().device_allocations, 1);
  a.deallocate(q, {});
}

TYPED_TEST(allocator_fixed_segments, blocks_split_and_merge_with_free_neighbours) {
  auto& a = this->make();
  void* x = a.allocate(256 * kib, {});
  void* y = a.allocate(256 * kib, {});
  void* z = a.allocate(256 * kib, {});
  EXPECT_EQ(static_cast<char*>(y), static_cast<char*>(x) + 256 * kib) << "carved from one segment in order";
  a.deallocate(y, {});
  auto st = a.stats();
  EXPECT_EQ(st.inactive_split.aggregate.current, 2) << "the hole and the segment's tail";
  EXPECT_EQ(st.inactive_split_bytes.aggregate.current, static_cast<std::int64_t>(2 * mib - 512 * kib));
  a.deallocate(x, {});
  a.deallocate(z, {});
  const auto snap = a.take_snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 1u) << "all merged back into one block";
  EXPECT_EQ(snap.segments[0].blocks[0].size, 2 * mib);
  EXPECT_EQ(a.stats().inactive_split.aggregate.current, 0);
}

TYPED_TEST(allocator_fixed_segments, a_large_block_holds_what_was_asked_and_its_rest_joins_the_next_free) {
  auto& a = this->make();
  void* first = a.allocate(4 * mib, {});
  void* second = a.allocate(4 * mib, {});  // the 20 MiB segment's last 12 MiB stay free
  a.deallocate(first, {});
  // The 4 MiB hole is the best fit and leaves 512 KiB: split off, not
  // counted as allocated with the block.
  void* p = a.allocate(3 * mib + 512 * kib, {});
  ASSERT_EQ(p, first);
  EXPECT_EQ(a.block_size(p), 3 * mib + 512 * kib);
  EXPECT_EQ(a.stats().allocated_bytes.aggregate.current, static_cast<std::int64_t>(7 * mib + 512 * kib));
  // Freed, the block after the rest merges with it and the tail: 16.5 MiB
  // serve 16.25 MiB without a second segment.
  a.deallocate(second, {});
  void* q = a.allocate(16 * mib + 256 * kib, {});
  EXPECT_EQ(static_cast<char*>(q), static_cast<char*>(p) + 3 * mib + 512 * kib);
  EXPECT_EQ(a.stats().device_allocations, 1);
  for (void* v : {p, q}) a.deallocate(v, {});
}

TYPED_TEST(allocator_basic, many_neighbours_freed_in_a_row_merge_back_into_one_block) {
  // More frees than the quick list holds, each next to the one before: the
  // list settles while a neighbour is being parked.
  auto& a = this->make();
  std::vector<void*> run;
  for (int i = 0; i < 40; ++i) run.push_back(a.allocate(4 * kib, {}));
  for (void* p : run) a.deallocate(p, {});
  void* again = a.allocate(4 * kib, {});
  // Debug mode settles every free at once (no quick list): the run has
  // merged already, and the block comes from its start.
  if (!this->debug) EXPECT_EQ(again, run.back()) << "the last freed block is reused first";
  a.deallocate(again, {});
  const auto snap = a.take_snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].blocks.size(), 1u);
  EXPECT_EQ(a.stats().inactive_split.aggregate.current, 0);
}

TYPED_TEST(allocator_basic, the_best_fitting_free_block_is_chosen) {
  auto& a = this->make();
  std::vector<void*> keep, holes;
  for (std::size_t size : {16 * kib, 8 * kib, 32 * kib}) {
    holes.push_back(a.allocate(size, {}));
    keep.push_back(a.allocate(512, {}));  // separates the holes
  }
  for (void* h : holes) a.deallocate(h, {});
  void* p = a.allocate(6 * kib, {});
  EXPECT_EQ(p, holes[1]) << "the 8 KiB hole is the best fit for 6 KiB";
  void* q = a.allocate(12 * kib, {});
  EXPECT_EQ(q, holes[0]);
  for (void* v : keep) a.deallocate(v, {});
  for (void* v : {p, q}) a.deallocate(v, {});
}

TYPED_TEST(allocator_fixed_segments, oversize_blocks_are_never_split_and_serve_only_near_sizes) {
  auto& a = this->make("max_split_size_mb:32,max_non_split_rounding_mb:2,release_idle_before_grow:false");
  void* big = a.allocate(40 * mib, {});
  a.deallocate(big, {});
  void* small = a.allocate(2 * mib, {});
  EXPECT_NE(small, big) << "a request under max_split_size never takes an oversize block";
  void* far = a.allocate(37 * mib, {});
  EXPECT_NE(far, big) << "40 MiB is more than 2 MiB larger than 37 MiB";
  void* near = a.allocate(39 * mib, {});
  EXPECT_EQ(near, big);
  EXPECT_EQ(a.block_size(near), 40 * mib) << "handed out whole, not split";
  for (void* v : {small, far, near}) a.deallocate(v, {});
  const auto snap = a.take_snapshot();
  for (const auto& s : snap.segments) {
    if (s.size == 40 * mib) EXPECT_EQ(s.blocks.size(), 1u) << "its own segment, exactly its size";
  }
}

TYPED_TEST(allocator_basic, a_block_just_under_max_split_size_is_reused_for_its_own_size) {
  auto& a = this->make("max_split_size_mb:64");
  const std::size_t just_under = 64 * mib - 800 * kib;  // its segment, 64 MiB, is itself oversize
  void* p = a.allocate(just_under, {});
  a.deallocate(p, {});
  EXPECT_EQ(a.allocate(just_under, {}), p);
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(64 * mib));
  a.deallocate(p, {});
}

TYPED_TEST(allocator_fixed_segments, statistics_count_and_return_to_zero) {
  auto& a = this->make();
  void* p = a.allocate(1000, {});
  void* q = a.allocate(3 * mib, {});
  auto st = a.stats();
  EXPECT_EQ(st.allocations.aggregate.current, 2);
  EXPECT_EQ(st.allocations.pool[0].current, 1);
  EXPECT_EQ(st.allocations.pool[1].current, 1);
  EXPECT_EQ(st.allocated_bytes.aggregate.current, static_cast<std::int64_t>(1024 + 3 * mib));
  EXPECT_EQ(st.requested_bytes.aggregate.current, static_cast<std::int64_t>(1000 + 3 * mib));
  EXPECT_EQ(st.active.aggregate.current, 2);
  a.deallocate(p, {});
  a.deallocate(q, {});
  st = a.stats();
  EXPECT_TRUE(nothing_in_use(st));
  EXPECT_EQ(st.allocations.aggregate.peak, 2);
  EXPECT_EQ(st.allocations.aggregate.allocated, 2);
  EXPECT_EQ(st.allocations.aggregate.freed, 2);
  a.reset_peak_stats();
  EXPECT_EQ(a.stats().allocations.aggregate.peak, 0);
  a.reset_accumulated_stats();
  st = a.stats();
  EXPECT_EQ(st.allocations.aggregate.allocated, 0);
  EXPECT_EQ(st.allocations.aggregate.freed, 0);
  EXPECT_EQ(st.device_allocations, 0);
  EXPECT_EQ(st.reserved_bytes.aggregate.current, static_cast<std::int64_t>(22 * mib)) << "the cache is kept";
  a.empty_cache();
  st = a.stats();
  EXPECT_EQ(st.reserved_bytes.aggregate.current, 0);
  EXPECT_EQ(st.segments.aggregate.current, 0);
  EXPECT_EQ(st.device_frees, 2);
}

TYPED_TEST(allocator_fixed_segments, snapshot_and_trace_export) {
  auto& a = this->make("trace_entries:4");
  void* p = a.allocate(4096, {});
  auto snap = a.take_snapshot();
  EXPECT_EQ(count_blocks(snap, block_state::allocated), 1u);
  EXPECT_EQ(count_blocks(snap, block_state::free), 1u);
  EXPECT_NE(snap.to_json().find("\"state\":\"allocated\""), std::string::npos);
  a.deallocate(p, {});
  a.empty_cache();
  const auto trace = a.trace();
  ASSERT_EQ(trace.size(), 4u) << "the ring keeps the last 4 of 5 records";
  EXPECT_EQ(trace[0].action, alloc::trace_action::alloc);
  EXPECT_EQ(trace[1].action, alloc::trace_action::free_requested);
  EXPECT_EQ(trace[2].action, alloc::trace_action::free_completed);
  EXPECT_EQ(trace[3].action, alloc::trace_action::segment_free);
  const std::string json = alloc::to_json(trace);
  EXPECT_NE(json.find("\"action\":\"segment_free\""), std::string::npos);
  EXPECT_NE(a.stats().to_json().find("\"reserved_bytes\""), std::string::npos);
}

TYPED_TEST(allocator_fixed_segments, every_pair_of_the_cached_path_is_traced) {
  // The common free and the parked hand-out have paths of their own: a trace
  // being kept must still see each allocation and each free's two steps.
  auto& a = this->make("trace_entries:64");
  for (int i = 0; i < 4; ++i) a.deallocate(a.allocate(4096, {}), {});
  std::size_t allocs = 0, requested = 0, completed = 0;
  for (const auto& r : a.trace()) {
    allocs += r.action == alloc::trace_action::alloc ? 1 : 0;
    requested += r.action == alloc::trace_action::free_requested ? 1 : 0;
    completed += r.action == alloc::trace_action::free_completed ? 1 : 0;
  }
  EXPECT_EQ(allocs, 4u);
  EXPECT_EQ(requested, 4u);
  EXPECT_EQ(completed, 4u);
}

TYPED_TEST(allocator_basic, bad_input_gives_typed_errors_and_loses_nothing) {
  auto& a = this->make();
  int on_stack = 0;
  EXPECT_THROW((void)a.allocate(0, {}), invalid_argument);
  EXPECT_THROW((void)a.allocate(std::size_t{1} << 62, {}), out_of_memory);
  EXPECT_THROW(a.deallocate(&on_stack, {}), invalid_argument);
  EXPECT_THROW(a.deallocate(nullptr, {}), invalid_argument) << "a null free is a caller's bug, not free(NULL)";
  EXPECT_THROW((void)a.block_size(&on_stack), invalid_argument);
  EXPECT_THROW(a.record_stream(&on_stack, {}), invalid_argument);
  void* p = a.allocate(4096, {});
  EXPECT_THROW(a.deallocate(static_cast<char*>(p) + 512, {}), invalid_argument) << "interior pointer";
  a.deallocate(p, {});
  EXPECT_THROW(a.deallocate(p, {}), invalid_argument) << "double free";
  int not_a_stream = 0;
  void* q = a.allocate(4096, {});
  EXPECT_THROW(a.deallocate(q, backend::stream_ref{&not_a_stream}), invalid_argument);
  EXPECT_EQ(a.block_size(q), 4096u) << "the refused free left the block allocated";
  a.deallocate(q, {});
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

// One owner per block: allocate_claimed hands a block out claimed, a second
// claim is refused, and the claim ends with the free (the same memory handed
// out again by plain allocate is unclaimed).
TYPED_TEST(allocator_basic, a_block_allocated_claimed_refuses_a_second_owner_until_its_free) {
  auto& a = this->make();
  void* p = a.allocate_claimed(4096, {});
  EXPECT_THROW(a.claim(p), invalid_argument) << "handed out claimed";
  EXPECT_NO_THROW(a.check_invariants());
  a.deallocate(p, {});
  EXPECT_NO_THROW(a.check_invariants()) << "a free block still claimed";
  void* q = a.allocate(4096, {});
  ASSERT_EQ(q, p) << "the same cached block";
  EXPECT_NO_THROW(a.claim(q)) << "a plain allocation is unclaimed";
  a.deallocate(q, {});
  EXPECT_TRUE(nothing_in_use(a.stats()));
}

}  // namespace
}  // namespace shoal::testing
