// staging_frees (src/transfer/staging_frees.h) past the room it takes up
// front: more staging blocks whose frees the host refused than
// reserved_blocks are kept while the host has memory for the list, and
// freed again; when it has none either, the block past the room stays with
// the allocator and nothing ends the process. The engine's own paths to it:
// transfer_engine_host_failures_test.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/stream.h"
#include "support/backends.h"
#include "support/refused_allocations.h"
#include "transfer/staging_frees.h"

namespace shoal::testing {
namespace {

using backend::stream;
using transfer::staging_frees;

template <class Backend>
using staging_frees_test = backend_test<Backend>;
TYPED_TEST_SUITE(staging_frees_test, backend_types, backend_names);

std::int64_t allocated(const alloc::caching_allocator& pinned) {
  return pinned.stats().allocations.aggregate.current;
}

std::vector<void*> staging_blocks(alloc::caching_allocator& pinned, std::size_t count, backend::stream_ref s) {
  std::vector<void*> blocks;
  for (std::size_t i = 0; i < count; ++i) blocks.push_back(pinned.allocate(4096, s));
  return blocks;
}

TYPED_TEST(staging_frees_test, blocks_refused_past_the_room_taken_up_front_are_kept_and_freed_again) {
  stream s(this->device());
  alloc::caching_allocator pinned(this->device(), alloc::allocator_config::parse("memory:pinned_host"));
  staging_frees frees(pinned, s.ref());
  const std::size_t count = staging_frees::reserved_blocks + 4;
  for (void* block : staging_blocks(pinned, count, s.ref())) {
    const refusing_one_allocation refusal(1, [] {});  // the free's; the list's growth is allowed
    frees.free(block);
    ASSERT_TRUE(refusal.refused()) << "the free took no heap memory: the test shows nothing";
  }
  EXPECT_EQ(frees.kept(), count);
  EXPECT_EQ(allocated(pinned), static_cast<std::int64_t>(count)) << "a refused free freed its block";
  EXPECT_FALSE(frees.retry()) << "blocks were left after the host had memory again";
  EXPECT_EQ(frees.kept(), 0u);
  EXPECT_EQ(allocated(pinned), 0) << "a kept block was not freed again";
}

TYPED_TEST(staging_frees_test, a_block_refused_with_no_room_left_and_no_memory_for_the_list_stays_with_the_allocator) {
  stream s(this->device());
  alloc::caching_allocator pinned(this->device(), alloc::allocator_config::parse("memory:pinned_host"));
  staging_frees frees(pinned, s.ref());
  const std::vector<void*> blocks = staging_blocks(pinned, staging_frees::reserved_blocks + 1, s.ref());
  {
    const refusing_allocations refusal;  // the frees' and the list's
    for (void* block : blocks) frees.free(block);  // noexcept: a throw past the room would end the process
    ASSERT_GE(refusing_allocations::refused(), static_cast<int>(blocks.size())) << "the test refused too little";
  }
  EXPECT_EQ(frees.kept(), staging_frees::reserved_blocks) << "the room taken up front was not used, or grew";
  EXPECT_FALSE(frees.retry());
  EXPECT_EQ(allocated(pinned), 1) << "the block past the room should stay with the allocator";
  pinned.deallocate(blocks.back(), s.ref());  // what the allocator's end would do
  EXPECT_EQ(allocated(pinned), 0);
}

}  // namespace
}  // namespace shoal::testing
