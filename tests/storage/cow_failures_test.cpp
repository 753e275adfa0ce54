// Copy-on-write storages when a step of a materialization or a clone fails
// (the device refuses a copy or an event, the heap refuses memory): the
// call throws, and the family is left as it was — every storage still reads
// its data, no block is lost, and everything is freed once when the last
// storage goes. On the host backend, whose device calls a test can refuse.
// This binary links support/refused_allocations.cpp (its operator new).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <new>
#include <thread>
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

using namespace std::chrono_literals;
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
    ++copies;
  }
  backend::event_ref create_event() override {
    if (refuse_event.exchange(false)) throw backend_error("create_event", "refused by the test");
    const auto e = forwarding_device::create_event();
    ++live_events;
    return e;
  }
  void record(backend::event_ref e, stream_ref s) override {
    if (refuse_record.exchange(false)) throw backend_error("record", "refused by the test");
    forwarding_device::record(e, s);
  }
  void destroy_event(backend::event_ref e) override {
    // As CUDA in a sticky error state: every destroy refused while set.
    if (refuse_destroy) throw backend_error("destroy_event", "refused by the test");
    forwarding_device::destroy_event(e);
    --live_events;
  }

  std::atomic<bool> refuse_copy{false}, refuse_event{false}, refuse_record{false}, refuse_destroy{false};
  std::atomic<int> copies{0};       // copies enqueued
  std::atomic<int> live_events{0};  // events made and not destroyed
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
  /// Drops `st` with every heap allocation refused (the test fails if none was asked for).
  static void drop_without_host_memory(storage_t& st) {
    int refused = 0;
    {
      const refusing_allocations refuse;
      st = storage_t();
      refused = refusing_allocations::refused();
    }
    EXPECT_GT(refused, 0) << "the test refused nothing";
  }

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
// (which makes the context) and one that joins it: a clone not made leaves
// its source as it was.
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
    // A first clone that was not made leaves no context behind: the source's next write is in place.
    if (!first.valid()) EXPECT_FALSE(source.is_lazy()) << "the source was left lazy without a clone";
    for (const storage_t* st : {&source, &first, &second}) {
      if (st->valid()) EXPECT_TRUE(holds(*st, 0xAB, own));
    }
    source = storage_t();
    first = storage_t();
    second = storage_t();
    EXPECT_EQ(in_use(), 0) << "the family outlived its storages";
  }
}

TEST_F(cow_failures, a_family_whose_event_destroys_are_refused_is_still_freed_without_terminating) {
  const stream_ref own = new_stream(), writer = new_stream();
  auto source = filled(0xAB, own);
  auto clone = lazy_clone(source, own);
  device_.fill(writer, clone.mutable_data(writer), 0xCD, bytes);  // a copy: the context keeps its event
  clone = storage_t();
  device_.refuse_destroy = true;  // a device in a sticky error state
  source = storage_t();           // the last of the family: the context goes, its events with it
  device_.refuse_destroy = false;
  EXPECT_EQ(in_use(), 0);
}

TEST_F(cow_failures, an_ordering_event_whose_record_is_refused_is_not_leaked) {
  const stream_ref own = new_stream(), other = new_stream(), third = new_stream();
  auto source = filled(0xAB, own);
  source.record_stream(other);  // a clone on `third` waits for `own` and `other`, an event each
  const int events = device_.live_events.load();
  device_.refuse_record = true;
  EXPECT_THROW((void)lazy_clone(source, third), backend_error);
  EXPECT_EQ(device_.live_events.load(), events) << "the event made for the ordering was leaked";
  EXPECT_FALSE(source.is_lazy());
  source = storage_t();
  EXPECT_EQ(in_use(), 0);
}

// A storage cloned and its clone written again and again (say, a model's
// weights cloned each step): its family keeps one copy event per stream,
// not one per copy.
TEST_F(cow_failures, a_family_written_by_copies_again_and_again_keeps_one_event_per_stream) {
  const stream_ref own = new_stream(), writer = new_stream();
  auto source = filled(0xAB, own);
  const int events = device_.live_events.load();
  for (int i = 0; i < 50; ++i) {
    auto clone = lazy_clone(source, own);
    const stream_ref on = i % 2 == 0 ? writer : own;  // copies on both streams
    device_.fill(on, clone.mutable_data(on), 0xCD, bytes);
    clone = storage_t();
    // A clone written on `writer` is freed waiting for `own`, the stream it was made on (as
    // any storage used on two streams): its event goes back to the allocator's once passed.
    device_.synchronize(own);
    allocator_->process_pending_frees();
  }
  EXPECT_TRUE(source.is_lazy()) << "the family lives on with the source";
  // One copy event per stream in the family, and the one the allocator keeps for its frees.
  EXPECT_LE(device_.live_events.load(), events + 3) << "the copies' events grow with the number of copies";
  device_.fill(own, source.mutable_data(own), 0x11, bytes);  // the steal waits for every copy
  EXPECT_TRUE(holds(source, 0x11, own));
  source = storage_t();
  EXPECT_EQ(in_use(), 0);
}

// Each heap allocation an eager lazy_clone makes (of memory shared outside
// the process), refused in turn: a copy enqueued from the source is always
// recorded on it, so that the source's free waits for the copy's read.
TEST_F(cow_failures, an_eager_clone_refused_host_memory_never_leaves_its_copy_unrecorded) {
  const stream_ref own = new_stream(), other = new_stream(), third = new_stream();
  bool refused = true;
  for (int nth = 1; refused; ++nth) {
    SCOPED_TRACE(::testing::Message() << "allocation " << nth << " refused");
    auto source = filled(0xAB, own);
    source.record_stream(other);  // two streams: a third one spills to the heap
    source.mark_shared_outside_process();
    const int copies = device_.copies.load();
    storage_t copy;
    {
      refusing_one_allocation refuse(nth, [] {});
      try {
        copy = lazy_clone(source, third);
      } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): what is left is checked below
      }
      refused = refuse.refused();
    }
    if (device_.copies.load() > copies) {
      EXPECT_EQ(source.last_used_on(), third) << "a copy was enqueued, its read not recorded on the source";
    }
    if (copy.valid()) EXPECT_TRUE(holds(copy, 0xAB, third));
    source = storage_t();
    copy = storage_t();
    EXPECT_EQ(in_use(), 0);
  }
}

// An owner that frees the block it was handed and counts the calls it gets.
class counting_owner final : public storage::storage_owner {
 public:
  counting_owner(alloc::caching_allocator& a, void* data) : a_(a), data_(data) {}
  ~counting_owner() override { a_.deallocate(data_); }
  void storage_released(std::span<const stream_ref> used_on) noexcept override {
    ++released;
    streams = used_on.size();
  }
  int released = 0;
  std::size_t streams = 0;

 private:
  alloc::caching_allocator& a_;
  void* data_;
};

// A use on another stream after a materializing copy waits for the copy
// (stream_fences.h); the device refusing that wait's event fails the call
// and leaves the stream unordered, so the next use orders it.
TEST_F(cow_failures, a_use_whose_wait_for_the_copy_is_refused_waits_at_the_next_use) {
  const stream_ref own = new_stream(), x = new_stream(), y = new_stream();
  auto source = filled(0x11, own);
  auto clone = lazy_clone(source, own);
  std::atomic<bool> open{false};
  device_.host_task(x, [&open] {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (!open.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  });
  (void)clone.mutable_data(x);  // materializes: the copy waits on x
  device_.refuse_event = true;
  EXPECT_THROW((void)clone.mutable_data(y), backend_error);
  device_.fill(y, clone.mutable_data(y), 0x77, bytes);  // ordered now
  const auto until = std::chrono::steady_clock::now() + 300ms;
  while (!device_.query(y) && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  open = true;
  device_.synchronize(x);
  EXPECT_TRUE(holds(clone, 0x77, y)) << "the copy on x overwrote the write made on y";
}

// A lazy clone dropped with a stream it cannot record (no host memory for
// it) waits for that stream instead and still lets its reference go: the
// family's last member then writes in place, and its data is freed once.
TEST_F(cow_failures, a_lazy_clone_dropped_without_memory_to_record_its_streams_still_lets_its_reference_go) {
  const stream_ref own = new_stream(), reader = new_stream();
  auto source = filled(0xAB, own);
  auto clone = lazy_clone(source, own);
  clone.record_stream(reader);  // the drop must remember it on the shared data
  drop_without_host_memory(clone);
  const void* shared = source.data();
  EXPECT_EQ(source.mutable_data(own), shared) << "the last member copied: the dropped clone's reference stayed";
  EXPECT_TRUE(holds(source, 0xAB, own));
  source = storage_t();
  EXPECT_EQ(in_use(), 0) << "the family's data was never freed";
}

// The same for a storage that owns its block: a stream the allocator has no
// memory to remember on the block is waited for, and the block is freed.
TEST_F(cow_failures, a_storage_dropped_without_memory_to_record_its_streams_is_still_freed) {
  const stream_ref own = new_stream(), a = new_stream(), b = new_stream();
  auto st = filled(0xAB, own);
  st.record_stream(a);
  st.record_stream(b);  // a third stream: the storage's own list spills to the heap, before the refusal
  drop_without_host_memory(st);
  EXPECT_EQ(in_use(), 0) << "the storage's block was kept for good";
}

// A family's final free comes on the first clone's stream, not the data's
// own, and so takes host memory (caching_allocator::deallocate_or_wait):
// refused, the data is freed after a wait on the host, not kept for good.
TEST_F(cow_failures, the_last_clone_of_a_family_dropped_without_host_memory_still_frees_the_data) {
  const stream_ref own = new_stream(), other = new_stream();
  auto source = filled(0xAB, own);
  auto clone = lazy_clone(source, other);
  source = storage_t();
  drop_without_host_memory(clone);
  EXPECT_EQ(in_use(), 0) << "the family's data was kept for good";
}

// A stealer's block is freed on its own stream, which is not the block's.
TEST_F(cow_failures, a_stealer_dropped_without_host_memory_is_still_freed) {
  const stream_ref own = new_stream(), other = new_stream();
  auto source = filled(0xAB, own);
  auto clone = lazy_clone(source, other);
  source = storage_t();
  (void)clone.mutable_data(other);  // the last member steals the data
  drop_without_host_memory(clone);
  EXPECT_EQ(in_use(), 0) << "the stolen block was kept for good";
}

// The block under storages made by allocate_parts: its final free, after a
// part recorded another stream, takes host memory too.
TEST_F(cow_failures, the_parts_block_dropped_without_host_memory_is_still_freed) {
  const stream_ref own = new_stream(), other = new_stream();
  const std::size_t sizes[] = {bytes, bytes};
  auto parts = storage_t::allocate_parts(*allocator_, sizes, own);
  parts[0].record_stream(other);
  parts[0] = storage_t();  // with host memory: `other` is recorded on the block
  drop_without_host_memory(parts[1]);  // the last part: the block's final free
  EXPECT_EQ(in_use(), 0) << "the parts' block was kept for good";
}

TEST_F(cow_failures, a_handed_over_storage_whose_streams_cannot_be_recorded_still_tells_its_owner) {
  const stream_ref own = new_stream(), other = new_stream();
  auto st = filled(0xAB, own);
  st.record_stream(other);  // the allocator needs heap memory to remember it on the block
  std::shared_ptr<counting_owner> owner;
  (void)st.hand_over(
      [&](void* data, std::size_t) {
        owner = std::make_shared<counting_owner>(*allocator_, data);
        return owner;
      },
      own);
  drop_without_host_memory(st);
  EXPECT_EQ(owner->released, 1) << "the owner was never told its storage went";
  EXPECT_EQ(owner->streams, 2u);
  owner.reset();
  EXPECT_EQ(in_use(), 0);
}

}  // namespace
}  // namespace shoal::testing
