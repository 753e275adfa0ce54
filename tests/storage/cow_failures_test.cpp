// Copy-on-write storages when a step of a materialization or a clone fails
// (the device refuses a copy or an event, the heap refuses memory): the
// call throws, and the family is left as it was — every storage still reads
// its data, no block is lost, and everything is freed once when the last
// storage goes. On the host backend, whose device calls a test can refuse.
// This binary links support/refused_allocations.cpp (its operator new).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/storage/storage.h"
#include "support/backends.h"
#include "support/forwarding_device.h"
#include "support/refused_allocations.h"

namespace shoal::testing {
namespace {

using backend::stream_ref;
using storage::lazy_clone;
using storage_t = storage::storage;
constexpr std::size_t bytes = 64 * 1024;

// The host device, refusing the next copy or event creation when told to,
// and running `during_copy` (once) inside the next copy call.
class refusing_device final : public forwarding_device {
 public:
  refusing_device() : forwarding_device(backend::host_device_instance()) {}

  void copy(stream_ref s, void* dst, const void* src, std::size_t n) override {
    if (during_copy) std::exchange(during_copy, nullptr)();
    if (refuse_copy.exchange(false)) throw backend_error("copy", "refused by the test");
    forwarding_device::copy(s, dst, src, n);
  }
  backend::event_ref create_event() override {
    if (refuse_event.exchange(false)) throw backend_error("create_event", "refused by the test");
    return forwarding_device::create_event();
  }

  std::atomic<bool> refuse_copy{false}, refuse_event{false};
  std::function<void()> during_copy;  // set and run on the test's thread
};

class cow_failures : public ::testing::Test {
 protected:
  storage_t filled(std::uint8_t value, stream_ref s) {
    auto st = storage_t::allocate(*allocator_, bytes, s);
    device_.fill(s, st.mutable_data(s), value, bytes);
    return st;
  }
  bool holds(const storage_t& st, std::uint8_t value, stream_ref s) {
    std::vector<std::uint8_t> out(st.size());
    device_.copy(s, out.data(), st.data(), st.size());
    device_.synchronize(s);
    return all_equal(out, value);
  }
  /// Blocks in use, once every stream has passed what was enqueued.
  std::int64_t in_use() {
    for (auto& s : streams_) s.synchronize();
    allocator_->process_pending_frees();
    return allocator_->stats().allocations.aggregate.current;
  }
  stream_ref new_stream() { return streams_.emplace_back(device_).ref(); }

  refusing_device device_;
  std::deque<backend::stream> streams_;  // outlive the allocator, as it requires
  std::unique_ptr<alloc::caching_allocator> allocator_ =
      std::make_unique<alloc::caching_allocator>(device_, alloc::allocator_config{});
};

TEST_F(cow_failures, a_clone_whose_materializing_copy_is_refused_stays_lazy_and_keeps_its_reference) {
  const stream_ref own = new_stream(), writer = new_stream();
  auto source = filled(0xAB, own);
  auto failed = lazy_clone(source, own), other = lazy_clone(source, own);
  const auto blocks = in_use();
  device_.refuse_copy = true;
  EXPECT_THROW((void)failed.mutable_data(writer), backend_error);
  EXPECT_TRUE(failed.is_lazy());
  EXPECT_EQ(failed.data(), source.data());
  EXPECT_EQ(in_use(), blocks) << "the copy's block was lost";
  failed = storage_t();
  source = storage_t();  // `other` is the last reference now
  auto next = filled(0x00, own);
  EXPECT_TRUE(holds(other, 0xAB, own)) << "the shared data was freed under a live clone";
  other = storage_t();
  next = storage_t();
  EXPECT_EQ(in_use(), 0);
}

TEST_F(cow_failures, a_clone_whose_copy_event_is_refused_can_write_once_the_device_lets_it) {
  const stream_ref own = new_stream();  // one stream: the copy's end is the only event
  auto source = filled(0xAB, own);
  auto failed = lazy_clone(source, own), other = lazy_clone(source, own);
  const auto blocks = in_use();
  device_.refuse_event = true;
  EXPECT_THROW((void)failed.mutable_data(own), backend_error);
  EXPECT_TRUE(failed.is_lazy());
  EXPECT_EQ(in_use(), blocks) << "the copy's block was lost";
  device_.fill(own, failed.mutable_data(own), 0xCD, bytes);  // a copy of its own this time
  EXPECT_FALSE(failed.is_lazy());
  source = storage_t();
  failed = storage_t();
  EXPECT_TRUE(holds(other, 0xAB, own)) << "the shared data was freed under a live clone";
  other = storage_t();
  EXPECT_EQ(in_use(), 0);
}

TEST_F(cow_failures, a_copier_left_last_by_its_copy_frees_the_shared_data) {
  const stream_ref own = new_stream(), writer = new_stream();
  auto source = filled(0xAB, own);
  auto clone = lazy_clone(source, own);
  device_.during_copy = [&] { source = storage_t(); };  // the others go while the copy is enqueued
  device_.fill(writer, clone.mutable_data(writer), 0xCD, bytes);
  EXPECT_FALSE(clone.is_lazy());
  EXPECT_TRUE(holds(clone, 0xCD, writer));
  EXPECT_EQ(in_use(), 1) << "the shared data outlived its family";
  clone = storage_t();
  EXPECT_EQ(in_use(), 0);
}

TEST_F(cow_failures, a_last_reference_whose_steal_is_refused_stays_lazy_and_is_freed_once) {
  const stream_ref own = new_stream(), cloned_on = new_stream();
  auto source = filled(0xAB, own);
  (void)lazy_clone(source, cloned_on);  // gone at once: the steal waits for cloned_on by an event
  device_.refuse_event = true;
  EXPECT_THROW((void)source.mutable_data(own), backend_error);
  EXPECT_TRUE(source.is_lazy());
  EXPECT_TRUE(holds(source, 0xAB, own));
  source = storage_t();
  EXPECT_EQ(in_use(), 0) << "the data of a failed steal was never freed";
}

// Each heap allocation lazy_clone makes, refused in turn, for a first clone
// (which makes the context) and one that joins it.
TEST_F(cow_failures, a_lazy_clone_refused_host_memory_at_any_step_leaves_the_family_whole) {
  const stream_ref own = new_stream(), other = new_stream();
  bool refused = true;
  for (int nth = 1; refused; ++nth) {
    SCOPED_TRACE(::testing::Message() << "allocation " << nth << " refused");
    auto source = filled(0xAB, own);
    source.record_stream(other);  // one more stream for the clone to note
    storage_t first, second;
    {
      refusing_one_allocation refuse(nth, [] {});
      try {
        first = lazy_clone(source, own);
        second = lazy_clone(source, other);
      } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): what is left is checked below
      }
      refused = refuse.refused();
    }
    for (const storage_t* st : {&source, &first, &second}) {
      if (st->valid()) EXPECT_TRUE(holds(*st, 0xAB, own));
    }
    source = storage_t();
    first = storage_t();
    second = storage_t();
    EXPECT_EQ(in_use(), 0) << "the family outlived its storages";
  }
}

}  // namespace
}  // namespace shoal::testing
