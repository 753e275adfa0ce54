// The device calls of expandable segments (growable ranges), counted by a
// device in between: a growth maps its chunks in one call with one access
// grant; a chunk given back by a growth past the peak is mapped again where
// the new block goes instead of being released and made anew; no physical
// chunk is held unmapped after a growth, an empty_cache, a refused growth or
// the allocator's end; stats().vmm_calls counts what the device saw.
#include <gtest/gtest.h>

#include <cstdint>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/core/error.h"
#include "support/backends.h"
#include "support/vmm_counting_device.h"

namespace shoal::testing {
namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

template <class Backend>
class vmm_calls : public backend_test<Backend> {
 protected:
  void SetUp() override {
    backend_test<Backend>::SetUp();
    if (this->IsSkipped()) return;
    if (!this->device().growable().supported) GTEST_SKIP() << "the device has no growable ranges";
    if (this->device().granularity() != 2 * mib) GTEST_SKIP() << "the chunk counts below assume 2 MiB granularity";
    counting_ = std::make_unique<vmm_counting_device>(this->device());
  }
  vmm_counting_device& dev() { return *counting_; }
  static alloc::allocator_config expandable() { return alloc::allocator_config::parse("expandable_segments:true"); }

  /// Fills `bytes` at `p` with `value` on the default stream and checks them.
  void fill_and_check(void* p, std::size_t bytes, std::uint8_t value) {
    this->device().fill({}, p, value, bytes);
    EXPECT_TRUE(all_equal(this->read(p, bytes), value));
  }

 private:
  std::unique_ptr<vmm_counting_device> counting_;
};
TYPED_TEST_SUITE(vmm_calls, backend_types, backend_names);

TYPED_TEST(vmm_calls, a_growth_maps_its_chunks_in_one_call_with_one_access_grant) {
  alloc::caching_allocator a(this->dev(), this->expandable());
  void* p = a.allocate(300 * mib, {});  // chunks of 128, 128 and 44 MiB
  this->fill_and_check(p, 300 * mib, 0x5A);
  EXPECT_EQ(this->dev().creates, 3);
  EXPECT_EQ(this->dev().map_chunks_calls, 1) << "one call maps the whole growth";
  EXPECT_EQ(this->dev().chunks_mapped, 3);
  EXPECT_EQ(this->dev().single_maps, 0);
  const alloc::vmm_call_counts c = a.stats().vmm_calls;
  EXPECT_EQ(c.creates, 3);
  EXPECT_EQ(c.maps, 3);
  EXPECT_EQ(c.access_grants, 1);
  EXPECT_EQ(c.unmaps + c.releases, 0);
  EXPECT_EQ(a.stats().device_allocations, 3);
  EXPECT_NE(a.stats().to_json().find("\"vmm_calls\":{\"creates\":3,\"releases\":0,\"maps\":3,\"unmaps\":0,"
                                     "\"access_grants\":1}"),
            std::string::npos);
  a.deallocate(p, {});
  a.empty_cache();
  EXPECT_EQ(a.stats().vmm_calls.unmaps, this->dev().unmaps);
  EXPECT_EQ(a.stats().vmm_calls.releases, this->dev().releases);
  a.reset_accumulated_stats();
  EXPECT_EQ(a.stats().vmm_calls.total(), 0) << "the counts are accumulated stats";
}

TYPED_TEST(vmm_calls, a_chunk_given_back_at_growth_past_the_peak_is_mapped_again_without_a_new_create) {
  alloc::caching_allocator a(this->dev(), this->expandable());
  void* first = a.allocate(24 * mib, {});
  void* second = a.allocate(24 * mib, {});
  EXPECT_EQ(this->dev().creates, 2);
  a.deallocate(first, {});
  // 48 MiB fit in no free block: the growth would pass the 48 MiB peak, so
  // the free chunk of `first` is unmapped first and serves half the new range.
  void* third = a.allocate(48 * mib, {});
  this->fill_and_check(third, 48 * mib, 0xA5);
  EXPECT_EQ(this->dev().unmaps, 1);
  EXPECT_EQ(this->dev().creates, 3) << "one new chunk, not two";
  EXPECT_EQ(this->dev().releases, 0) << "the chunk given back is mapped again, not released";
  EXPECT_EQ(this->dev().chunks_mapped, 4);
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.peak, static_cast<std::int64_t>(72 * mib));
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(72 * mib));
  a.check_invariants();
  a.deallocate(second, {});
  a.deallocate(third, {});
  a.empty_cache();
  EXPECT_EQ(this->dev().live_chunks(), 0);
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, 0);
}

TYPED_TEST(vmm_calls, a_growth_the_device_refuses_keeps_no_chunk_it_unmapped) {
  alloc::caching_allocator a(this->dev(), this->expandable());
  void* first = a.allocate(24 * mib, {});
  void* second = a.allocate(24 * mib, {});
  a.deallocate(first, {});
  this->dev().refuse_creates = true;
  EXPECT_THROW((void)a.allocate(48 * mib, {}), out_of_memory);
  this->dev().refuse_creates = false;
  a.check_invariants();  // every physical chunk held is mapped
  EXPECT_EQ(this->dev().live_chunks(), 1) << "only the chunk under `second` is left";
  EXPECT_EQ(a.stats().reserved_bytes.aggregate.current, static_cast<std::int64_t>(24 * mib));
  a.deallocate(second, {});
}

TYPED_TEST(vmm_calls, the_allocators_end_leaves_no_physical_chunk) {
  {
    alloc::caching_allocator a(this->dev(), this->expandable());
    void* first = a.allocate(24 * mib, {});
    void* second = a.allocate(24 * mib, {});
    a.deallocate(first, {});
    void* third = a.allocate(48 * mib, {});
    a.deallocate(third, {});
    (void)second;  // still allocated at the end
  }
  EXPECT_GT(this->dev().creates, 0);
  EXPECT_EQ(this->dev().live_chunks(), 0);
  EXPECT_EQ(this->dev().unmaps, this->dev().chunks_mapped);
}

}  // namespace
}  // namespace shoal::testing
