// Storages whose block a forced clear of its private pool took back
// (alloc::live_blocks::invalidate): dropping them is the late free that
// removes the tombstone, for a storage of its own and for lazy clones that
// share one block, so nothing stays behind once every storage is gone.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/storage/storage.h"
#include "support/allocators.h"
#include "support/region_pool.h"

namespace shoal::testing {
namespace {

using alloc::live_blocks;
using storage_t = storage::storage;
constexpr std::size_t mib = 1024 * 1024;

template <class Param>
using taken_storage = allocator_test<Param>;
TYPED_TEST_SUITE(taken_storage, backend_config_types, backend_config_names);

// Storages of the region, used on `side` too, whose blocks a forced clear
// takes; dropping `storages` must leave no tombstone and the region whole.
template <class Test>
void expect_dropping_removes_the_tombstones(Test& test, int blocks_taken,
                                            const std::function<std::vector<storage_t>(region_pool&,
                                                                                       backend::stream_ref)>& make) {
  auto& dev = test.device();
  backend::stream side(dev);  // outlives the allocator
  alloc::caching_allocator a(dev, alloc::allocator_config::parse(Test::configured_text("")));
  region_pool r(dev, a, 4 * mib);
  {
    std::vector<storage_t> storages = make(r, side);
    const auto taken = a.clear_private_pool(r.id, "", live_blocks::invalidate);
    EXPECT_EQ(static_cast<int>(taken.blocks.size()), blocks_taken);
    EXPECT_EQ(a.stats().invalidated.aggregate.current, blocks_taken);
  }  // the storages go: their late frees
  const auto st = a.stats();
  EXPECT_EQ(st.invalidated.aggregate.current, 0) << "a dropped storage left its tombstone: " << st.to_json();
  EXPECT_EQ(st.invalidated_bytes.aggregate.current, 0) << st.to_json();
  EXPECT_TRUE(nothing_in_use(st));
  EXPECT_NO_THROW(a.check_invariants());
  void* whole = r.allocate(4 * mib);
  EXPECT_EQ(whole, r.base) << "the region is one free block again";
  a.deallocate(whole, {});
  dev.synchronize(side);
  a.destroy_private_pool(r.id);
}

TYPED_TEST(taken_storage, dropping_a_storage_whose_block_was_taken_removes_its_tombstone) {
  expect_dropping_removes_the_tombstones(*this, 1, [](region_pool& r, backend::stream_ref side) {
    alloc::private_pool_scope scope(r.a, r.id);
    std::vector<storage_t> storages;
    storages.push_back(storage_t::allocate(r.a, mib, {}));
    storages.back().record_stream(side);
    return storages;
  });
}

TYPED_TEST(taken_storage, dropping_lazy_clones_whose_shared_block_was_taken_removes_its_tombstone) {
  expect_dropping_removes_the_tombstones(*this, 1, [](region_pool& r, backend::stream_ref side) {
    alloc::private_pool_scope scope(r.a, r.id);
    std::vector<storage_t> storages;
    storages.push_back(storage_t::allocate(r.a, mib, {}));
    storages.push_back(storage::lazy_clone(storages.back(), side));
    storages.back().record_stream(side);
    EXPECT_TRUE(storages.back().is_lazy());
    return storages;
  });
}

}  // namespace
}  // namespace shoal::testing
