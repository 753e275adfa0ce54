// Work shoal enqueues on a storage's data by itself — a materializing copy
// into it, a steal's waits for the family's copies and reads, an eager
// clone's copy out of it — comes before any later use of the storage on
// another stream (src/storage/stream_fences.h). The caller orders its own
// work across streams, or needs no order for disjoint writes; it cannot order
// work it never saw. Each test holds the stream shoal worked on with a host
// task, lets the other stream run as far as it can, then opens the hold:
// without the fences the other stream's write runs first. On both backends.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/storage/storage.h"
#include "support/backends.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream_ref;
using storage::lazy_clone;
using storage_t = storage::storage;
constexpr std::size_t bytes = 64 * 1024;

template <class Backend>
class storage_stream_fences : public backend_test<Backend> {
 protected:
  stream_ref new_stream() { return streams_.emplace_back(this->device()).ref(); }
  // Holds `s` until open() (at most 10 s), and opens it however the test ends.
  void hold(stream_ref s) {
    this->device().host_task(s, [this] {
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (!open_.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    });
  }
  void open() { open_.store(true); }
  storage_t filled(std::uint8_t value, stream_ref s) {
    if (!allocator_) allocator_.emplace(this->device(), alloc::allocator_config{});
    auto st = storage_t::allocate(*allocator_, bytes, s);
    this->device().fill(s, st.mutable_data(s), value, bytes);
    this->device().synchronize(s);
    return st;
  }
  // Up to 300 ms for `s` to run what it can (not what waits for a held stream).
  void settle(stream_ref s) {
    const auto until = std::chrono::steady_clock::now() + 300ms;
    while (!this->device().query(s) && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  }
  void finish() {
    open();
    for (auto& s : streams_) s.synchronize();
  }
  // Device memory a read copies into: a copy into pageable host memory would
  // return only once it ran on CUDA, so the test thread would wait out the hold.
  void* scratch() {
    void* p = allocator_->allocate(bytes, streams_.front().ref());
    scratch_.push_back(p);
    return p;
  }
  std::vector<std::uint8_t> read_scratch(const void* p) { return this->read(p, bytes, streams_.front().ref()); }
  static std::size_t count_of(const std::vector<std::uint8_t>& v, std::uint8_t value) {
    return static_cast<std::size_t>(std::ranges::count(v, value));
  }
  void TearDown() override {
    finish();
    for (void* p : scratch_) allocator_->deallocate(p, streams_.front().ref());
  }

  std::optional<alloc::caching_allocator> allocator_;  // after the base's SetUp found the device
  std::deque<backend::stream> streams_;
  std::vector<void*> scratch_;
  std::atomic<bool> open_{false};
};
TYPED_TEST_SUITE(storage_stream_fences, backend_types, backend_names);

TYPED_TEST(storage_stream_fences, a_write_on_a_second_stream_is_not_overwritten_by_the_materializing_copy) {
  const stream_ref own = this->new_stream(), x = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  auto clone = lazy_clone(source, own);
  this->hold(x);
  auto* first = static_cast<std::byte*>(clone.mutable_data(x));  // materializes: the copy waits on x
  this->device().fill(x, first, 0x22, bytes / 2);
  auto* second = static_cast<std::byte*>(clone.mutable_data(y));  // disjoint halves: no order needed between x and y
  this->device().fill(y, second + bytes / 2, 0x33, bytes / 2);
  this->settle(y);
  this->finish();
  const auto out = this->read(clone.data(), bytes, own);
  EXPECT_EQ(this->count_of(out, 0x22), bytes / 2);
  EXPECT_EQ(this->count_of(out, 0x33), bytes / 2) << "the materializing copy on x overwrote the write made on y";
}

TYPED_TEST(storage_stream_fences, a_stealer_writing_on_a_second_stream_leaves_a_clones_pending_copy_alone) {
  const stream_ref own = this->new_stream(), copier = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  auto clone = lazy_clone(source, own);
  this->hold(copier);
  (void)clone.mutable_data(copier);  // the clone's copy waits on `copier`
  (void)source.mutable_data(own);    // the last holder steals: `own` waits for that copy
  this->device().fill(y, source.mutable_data(y), 0x77, bytes);
  this->settle(y);
  this->finish();
  EXPECT_EQ(this->count_of(this->read(clone.data(), bytes, copier), 0x11), bytes)
      << "the clone's data changed: the stealer's write on y overtook its copy";
}

TYPED_TEST(storage_stream_fences, a_stealer_writing_on_a_second_stream_waits_for_a_dropped_clones_read) {
  const stream_ref own = this->new_stream(), reader = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  void* seen = this->scratch();
  this->hold(reader);
  {
    auto clone = lazy_clone(source, own);
    this->device().copy(reader, seen, clone.data(), bytes);
    clone.record_stream(reader);
  }
  (void)source.mutable_data(own);  // steals: `own` waits for the reader
  this->device().fill(y, source.mutable_data(y), 0x77, bytes);
  this->settle(y);
  this->finish();
  EXPECT_EQ(this->count_of(this->read_scratch(seen), 0x11), bytes) << "the dropped clone's read saw the stealer's later write";
}

TYPED_TEST(storage_stream_fences, a_mark_that_steals_orders_later_writes_on_other_streams_after_a_clones_copy) {
  const stream_ref own = this->new_stream(), copier = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  auto clone = lazy_clone(source, own);
  this->hold(copier);
  (void)clone.mutable_data(copier);
  source.mark_shared_outside_process(own);  // steals on `own`, writes nothing
  this->device().fill(y, source.mutable_data(y), 0x77, bytes);
  this->settle(y);
  this->finish();
  EXPECT_EQ(this->count_of(this->read(clone.data(), bytes, copier), 0x11), bytes)
      << "the clone's data changed: a write on y overtook its copy";
}

TYPED_TEST(storage_stream_fences, an_eager_clone_does_not_see_a_later_write_of_its_source_on_another_stream) {
  const stream_ref own = this->new_stream(), s = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  source.mark_shared_outside_process(own);  // lazy_clone makes an eager copy from now on
  this->hold(s);
  auto clone = lazy_clone(source, s);  // the copy waits on s
  this->device().fill(y, source.mutable_data(y), 0x77, bytes);
  this->settle(y);
  this->finish();
  EXPECT_EQ(this->count_of(this->read(clone.data(), bytes, s), 0x11), bytes)
      << "the clone shows a write its source had after lazy_clone returned";
}

// The eager clone's own copy is shoal's work on the clone's data too.
TYPED_TEST(storage_stream_fences, a_write_on_another_stream_of_an_eager_clone_is_not_overwritten_by_its_copy) {
  const stream_ref own = this->new_stream(), s = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  source.mark_shared_outside_process(own);  // lazy_clone makes an eager copy from now on
  this->hold(s);
  auto clone = lazy_clone(source, s);  // the copy into the clone waits on s
  this->device().fill(y, clone.mutable_data(y), 0x77, bytes);
  this->settle(y);
  this->finish();
  EXPECT_EQ(this->count_of(this->read(clone.data(), bytes, s), 0x77), bytes)
      << "the eager clone's copy on s overwrote the write made on y";
}

// enqueue_read records the read's stream with the pointer: a read on a
// second stream of a clone just materialized on another waits for the copy.
TYPED_TEST(storage_stream_fences, a_read_on_a_stream_waits_for_the_materializing_copy) {
  const stream_ref own = this->new_stream(), x = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  auto clone = lazy_clone(source, own);
  this->hold(x);
  (void)clone.mutable_data(x);  // materializes: the copy waits on x
  void* seen = this->scratch();
  clone.enqueue_read(y, [&](const void* data) { this->device().copy(y, seen, data, bytes); });
  this->settle(y);
  this->finish();
  EXPECT_EQ(this->count_of(this->read_scratch(seen), 0x11), bytes) << "the read on y ran before the copy into the data";
}

// enqueue_read holds the storage's lock to the read's enqueue: another
// thread's write that moves the storage and drop of the family's last other
// member (its final free) come after it, so the free waits for the read.
// Split (the pointer, then the enqueue), the free's event on y came before
// the read and the block went to a new owner while the read was queued.
TYPED_TEST(storage_stream_fences, a_read_is_not_overtaken_by_a_final_free_from_another_thread) {
  const stream_ref own = this->new_stream(), x = this->new_stream(), y = this->new_stream();
  auto source = this->filled(0x11, own);
  auto clone = lazy_clone(source, own);
  std::atomic<bool> second{false};
  this->hold(y);  // opened once the other thread is done
  void* seen = this->scratch();
  const void* read_from = nullptr;
  std::thread other;
  source.enqueue_read(y, [&](const void* data) {
    read_from = data;
    other = std::thread([&] {
      (void)source.mutable_data(x);  // the source moves to a copy of its own
      clone = storage_t();           // the family's final free
    });
    std::this_thread::sleep_for(50ms);  // the other thread goes through now, unless the lock holds it
    this->device().host_task(y, [&second] {
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (!second.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    });
    this->device().copy(y, seen, data, bytes);
  });
  other.join();
  this->open();  // y passes its first hold; the read still waits for `second`
  // The block's next owner, if the free let it go before the read ran.
  std::vector<void*> taken;
  const auto until = std::chrono::steady_clock::now() + 300ms;
  while (std::chrono::steady_clock::now() < until) {
    this->allocator_->process_pending_frees();
    void* q = this->allocator_->allocate(bytes, own);
    taken.push_back(q);
    if (q == read_from) {
      this->device().fill(own, q, 0x99, bytes);
      this->device().synchronize(own);
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  second = true;
  this->device().synchronize(y);
  EXPECT_EQ(this->count_of(this->read_scratch(seen), 0x11), bytes) << "the read on y saw the block's next owner's data";
  for (void* q : taken) this->allocator_->deallocate(q, own);
}

// The control: a storage shoal never worked on orders nothing across its
// streams (the caller's to order), so a write on a second stream runs while
// the first is held.
TYPED_TEST(storage_stream_fences, a_storage_shoal_never_worked_on_adds_no_wait_between_streams) {
  const stream_ref own = this->new_stream(), y = this->new_stream();
  auto st = this->filled(0x11, own);
  this->hold(own);
  this->device().fill(y, st.mutable_data(y), 0x77, bytes);
  this->settle(y);
  EXPECT_TRUE(this->device().query(y)) << "the write on y waited for the held stream";
}

}  // namespace
}  // namespace shoal::testing
