// Storages and copy-on-write lazy clones, on every backend under every
// allocator configuration (default, expandable_segments, debug).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/storage/storage.h"
#include "support/allocators.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using storage::lazy_clone;
using storage_t = storage::storage;
constexpr std::size_t bytes = 256 * 1024;

/// Holds `s` until `open` is set, or for at most `limit` (which only keeps a
/// failing test from hanging the stream).
void hold(backend::device& dev, backend::stream_ref s, std::atomic<bool>& open, std::chrono::milliseconds limit) {
  dev.host_task(s, [&open, limit] {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!open.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  });
}

/// Whether `s` passes the work enqueued on it within `limit`.
bool passes_within(backend::device& dev, backend::stream_ref s, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!dev.query(s)) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

std::size_t pending_frees(alloc::caching_allocator& a) {
  a.process_pending_frees();
  return count_blocks(a.take_snapshot(), alloc::block_state::pending_free);
}

template <class Backend>
class storage_test : public allocator_test<Backend> {
 public:
  /// A storage filled with `value`, written and finished on `s`.
  storage_t filled(std::uint8_t value, backend::stream_ref s = {}) {
    auto st = storage_t::allocate(*this->allocator_, bytes, s);
    this->device().fill(s, st.mutable_data(s), value, bytes);
    this->device().synchronize(s);
    return st;
  }
  bool holds(const storage_t& st, std::uint8_t value, backend::stream_ref s = {}) {
    return all_equal(this->read(st.data(), st.size(), s), value);
  }
  /// A copy of `source` enqueued on `s` into device memory: a copy to
  /// pageable host memory would run synchronously on CUDA, so it could not
  /// stay queued behind a held stream.
  storage_t queued_copy(const storage_t& source, backend::stream_ref s) {
    auto copy = storage_t::allocate(*this->allocator_, source.size(), s);
    this->device().copy(s, copy.mutable_data(s), source.data(), source.size());
    return copy;
  }
  std::int64_t allocations() { return this->allocator_->stats().allocations.aggregate.allocated; }
  /// A new stream that outlives the test's allocator, as the allocator
  /// requires: its pools and debug poison fills use the stream until it goes.
  backend::stream_ref new_stream() { return streams_.emplace_back(this->device()); }
  void TearDown() override { this->allocator_.reset(); }  // before streams_

 private:
  std::deque<stream> streams_;
};
TYPED_TEST_SUITE(storage_test, backend_config_types, backend_config_names);

// The same storages with cross_stream_safety off: the allocator then waits
// for no stream a block was freed on, only for those recorded.
template <class Backend>
class storage_unsafe_test : public storage_test<Backend> {};
TYPED_TEST_SUITE(storage_unsafe_test, unsafe_config_types, backend_config_names);

TYPED_TEST(storage_test, handles_alias_iff_they_name_one_storage) {
  this->make();
  auto a = this->filled(1);
  storage_t same = a;
  auto other = this->filled(1);
  EXPECT_TRUE(a.aliases(same));
  EXPECT_FALSE(a.aliases(other));
  EXPECT_EQ(a.size(), bytes);
  EXPECT_EQ(&a.device(), &this->device());
  auto clone = lazy_clone(a);
  EXPECT_FALSE(clone.aliases(a)) << "a clone is a storage of its own";
  EXPECT_THROW((void)storage_t{}.data(), invalid_argument);
}

TYPED_TEST(storage_test, a_lazy_clone_copies_nothing_and_reads_never_copy) {
  this->make();
  auto a = this->filled(7);
  const auto before = this->allocations();
  auto b = lazy_clone(a);
  auto c = lazy_clone(b);  // cloning a clone joins the family
  EXPECT_EQ(b.data(), a.data());
  EXPECT_EQ(c.data(), a.data());
  EXPECT_TRUE(a.is_lazy() && b.is_lazy() && c.is_lazy());
  EXPECT_TRUE(this->holds(c, 7));
  EXPECT_EQ(this->allocations(), before) << "neither cloning nor reading allocated";
}

TYPED_TEST(storage_test, the_first_write_copies_and_the_last_reference_steals) {
  this->make();
  auto a = this->filled(7);
  auto b = lazy_clone(a);
  const void* shared = a.data();
  const auto before = this->allocations();
  void* bw = b.mutable_data();
  EXPECT_NE(bw, shared) << "b was not the last reference: it copied";
  EXPECT_FALSE(b.is_lazy());
  EXPECT_EQ(this->allocations(), before + 1);
  EXPECT_TRUE(this->holds(b, 7)) << "the copy holds the data";
  void* aw = a.mutable_data();
  EXPECT_EQ(aw, shared) << "a is the last reference: it stole the data";
  EXPECT_FALSE(a.is_lazy());
  EXPECT_EQ(this->allocations(), before + 1) << "stealing copies nothing";
}

TYPED_TEST(storage_test, writes_after_the_clone_stay_private) {
  auto& dev = this->device();
  this->make();
  auto a = this->filled(0xA1);
  auto b = lazy_clone(a);
  dev.fill({}, b.mutable_data(), 0xB2, bytes);
  EXPECT_TRUE(this->holds(a, 0xA1));
  EXPECT_TRUE(this->holds(b, 0xB2));
  auto c = lazy_clone(a);
  dev.fill({}, a.mutable_data(), 0xA3, bytes);
  EXPECT_TRUE(this->holds(c, 0xA1)) << "c keeps the data as it was when it was cloned";
  EXPECT_TRUE(this->holds(a, 0xA3));
}

TYPED_TEST(storage_test, data_is_released_exactly_once) {
  this->make();
  {
    auto a = this->filled(3);
    auto b = lazy_clone(a);
    auto c = lazy_clone(b);
    { auto drop = std::move(a); }  // the first owner goes; the data stays
    EXPECT_TRUE(this->holds(c, 3));
    (void)b.mutable_data();
    EXPECT_TRUE(this->holds(c, 3));
  }
  this->allocator_->empty_cache();
  const auto st = this->allocator_->stats();
  EXPECT_TRUE(nothing_in_use(st));
  EXPECT_EQ(st.allocations.aggregate.allocated, st.allocations.aggregate.freed);
}

TYPED_TEST(storage_test, the_materializing_copy_waits_for_writes_made_before_the_clone) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref writer = this->new_stream(), reader = this->new_stream();
  auto a = this->filled(0);
  dev.delay(writer, 150ms);
  dev.fill(writer, a.mutable_data(writer), 0x5A, bytes);  // still queued when the clone is made
  auto b = lazy_clone(a, writer);
  (void)b.mutable_data(reader);  // copies on `reader`, after `writer`'s fill
  EXPECT_TRUE(this->holds(b, 0x5A, reader));
}

TYPED_TEST(storage_test, a_clone_made_without_a_stream_waits_for_the_source_s_last_write) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref writer = this->new_stream(), reader = this->new_stream();
  auto a = this->filled(0);
  // The write waits until the reader has run past the clone's copy (or
  // 200 ms): a copy not ordered after the write reads the old bytes, always.
  std::atomic<bool> copied{false};
  hold(dev, writer, copied, 200ms);
  dev.fill(writer, a.mutable_data(writer), 0x5A, bytes);
  EXPECT_EQ(a.last_used_on(), writer);
  auto b = lazy_clone(a);  // this thread's current stream is the idle default stream
  EXPECT_EQ(b.last_used_on(), writer) << "a clone is for use where its source was last used";
  (void)b.mutable_data(reader);
  dev.host_task(reader, [&copied] { copied.store(true); });
  EXPECT_TRUE(this->holds(b, 0x5A, reader)) << "the copy overtook the source's last write";
  dev.synchronize(writer);
}

TYPED_TEST(storage_test, a_lazy_clone_read_on_its_own_stream_waits_for_the_source_s_writes_on_other_streams) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref writer = this->new_stream(), reader = this->new_stream();
  auto a = this->filled(0);
  // The write waits until the reader has run past its read of the clone (or
  // 200 ms): a read not ordered after the write reads the old bytes, always.
  std::atomic<bool> read{false};
  hold(dev, writer, read, 200ms);
  dev.fill(writer, a.mutable_data(writer), 0x5A, bytes);
  auto b = lazy_clone(a, reader);
  EXPECT_TRUE(b.is_lazy()) << "the lazy path, not an eager copy";
  auto seen = this->queued_copy(b, reader);  // reads b's shared data on reader, copying nothing into b
  dev.host_task(reader, [&read] { read.store(true); });
  EXPECT_TRUE(this->holds(seen, 0x5A, reader)) << "the clone's read on its own stream overtook the source's write";
  EXPECT_EQ(b.data(), a.data()) << "the read did not materialize the clone";
  dev.synchronize(writer);
}

TYPED_TEST(storage_test, a_storage_is_freed_after_every_stream_it_was_used_on_wherever_it_is_dropped) {
  auto& dev = this->device();
  auto& alloc = this->make();
  const backend::stream_ref own = this->new_stream(), reader = this->new_stream(), elsewhere = this->new_stream();
  auto st = this->filled(0x11, own);
  std::atomic<bool> open{false};
  hold(dev, reader, open, 10s);
  auto seen = this->queued_copy(st, reader);  // queued behind the hold
  st.record_stream(reader);
  {
    backend::stream_guard on_elsewhere(dev, elsewhere);
    st = storage_t();  // dropped where the current stream is neither of its streams
  }
  EXPECT_EQ(pending_frees(alloc), 1u) << "freed while a stream it was used on still had its read queued";
  open.store(true);
  dev.synchronize(reader);
  EXPECT_EQ(pending_frees(alloc), 0u);
  EXPECT_TRUE(this->holds(seen, 0x11, reader));
}

TYPED_TEST(storage_test, shared_data_is_freed_after_the_streams_of_every_clone) {
  auto& dev = this->device();
  auto& alloc = this->make();
  const backend::stream_ref reader = this->new_stream(), elsewhere = this->new_stream();
  auto a = this->filled(0x22);
  auto b = lazy_clone(a);
  std::atomic<bool> open{false};
  hold(dev, reader, open, 10s);
  auto seen = this->queued_copy(b, reader);
  b.record_stream(reader);
  {
    backend::stream_guard on_elsewhere(dev, elsewhere);
    b = storage_t();  // b goes first: its use is left to whoever frees the data
    a = storage_t();
  }
  EXPECT_EQ(pending_frees(alloc), 1u) << "the shared data was freed while a clone's read was queued";
  open.store(true);
  dev.synchronize(reader);
  EXPECT_EQ(pending_frees(alloc), 0u);
  EXPECT_TRUE(this->holds(seen, 0x22, reader));
}

TYPED_TEST(storage_test, a_stealer_keeps_the_streams_it_was_used_on) {
  auto& dev = this->device();
  auto& alloc = this->make();
  const backend::stream_ref cloned_on = this->new_stream(), reader = this->new_stream(), writer = this->new_stream(),
                            elsewhere = this->new_stream();
  auto a = this->filled(0x44);
  auto b = lazy_clone(a, cloned_on);
  std::atomic<bool> open{false};
  hold(dev, reader, open, 10s);
  auto seen = this->queued_copy(b, reader);
  b.record_stream(reader);
  a = storage_t();
  const void* shared = b.data();
  EXPECT_EQ(b.mutable_data(writer), shared) << "the last reference steals";
  {
    backend::stream_guard on_elsewhere(dev, elsewhere);
    b = storage_t();
  }
  EXPECT_EQ(pending_frees(alloc), 1u) << "freed while the stealer's read was queued";
  open.store(true);
  dev.synchronize(reader);
  dev.synchronize(writer);
  EXPECT_EQ(pending_frees(alloc), 0u);
  EXPECT_TRUE(this->holds(seen, 0x44, reader));
}

// A lazy storage's write copies into a block of the writer's stream; a read
// queued on the stream the storage was allocated on (which needs no record)
// still holds that block's free. It was freed on the writer's stream alone:
// whether a storage's first stream was kept depended on a clone another
// thread had made.
TYPED_TEST(storage_test, a_copy_for_a_write_keeps_the_streams_the_storage_was_used_on) {
  auto& dev = this->device();
  auto& alloc = this->make();
  const backend::stream_ref first = this->new_stream(), writer = this->new_stream(), elsewhere = this->new_stream();
  auto a = this->filled(0x11, first);
  auto snapshot = lazy_clone(a, first);  // another holder: a's write copies
  void* copied = a.mutable_data(writer);
  dev.fill(writer, copied, 0x22, bytes);
  dev.synchronize(writer);
  std::atomic<bool> open{false};
  hold(dev, first, open, 10s);
  auto seen = this->queued_copy(a, first);  // a read of the new data on its first stream
  {
    backend::stream_guard on_elsewhere(dev, elsewhere);
    a = storage_t();
  }
  EXPECT_EQ(pending_frees(alloc), 1u) << "freed while a read on the storage's first stream was queued";
  open.store(true);
  dev.synchronize(first);
  EXPECT_EQ(pending_frees(alloc), 0u);
  EXPECT_TRUE(this->holds(seen, 0x22, first));
}

TYPED_TEST(storage_test, the_source_outlives_a_pending_copy) {
  auto& dev = this->device();
  auto& alloc = this->make();
  const backend::stream_ref owner = this->new_stream(), copier = this->new_stream();
  auto a = this->filled(0x11, owner);
  auto b = lazy_clone(a, owner);
  dev.delay(copier, 200ms);
  (void)b.mutable_data(copier);  // the copy waits behind the delay
  {
    auto drop = std::move(a);  // the last other reference: the data goes back to the allocator
    backend::stream_guard on_owner(dev, owner);
  }
  void* reused = alloc.allocate(bytes, owner);
  dev.fill(owner, reused, 0xEE, bytes);  // would overwrite the source if it were handed out
  EXPECT_TRUE(this->holds(b, 0x11, copier));
  alloc.deallocate(reused, owner);
}

TYPED_TEST(storage_test, a_stealer_waits_for_copies_before_writing_in_place) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref owner = this->new_stream(), copier = this->new_stream();
  auto a = this->filled(0x22, owner);
  auto b = lazy_clone(a, owner);
  dev.delay(copier, 200ms);
  (void)b.mutable_data(copier);  // b copies, later, on `copier`
  dev.fill(owner, a.mutable_data(owner), 0x33, bytes);  // a steals and writes at once
  EXPECT_TRUE(this->holds(b, 0x22, copier)) << "a's write overtook b's copy";
  EXPECT_TRUE(this->holds(a, 0x33, owner));
}

// A clone read on a stream of its own, recorded, then gone: the source, now
// the last reference, writes in place only after that read.
TYPED_TEST(storage_test, a_stealer_waits_for_the_reads_of_a_dropped_clone_before_writing_in_place) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref owner = this->new_stream(), cloned_on = this->new_stream(),
                            reader = this->new_stream();
  auto a = this->filled(0x11, owner);
  std::atomic<bool> open{false};
  hold(dev, reader, open, 10s);
  storage_t seen;
  {
    auto b = lazy_clone(a, cloned_on);
    seen = this->queued_copy(b, reader);
    b.record_stream(reader);
  }
  dev.fill(owner, a.mutable_data(owner), 0x77, bytes);  // a steals and writes in place
  EXPECT_FALSE(passes_within(dev, owner, 100ms)) << "a's write did not wait for the read";
  open.store(true);
  EXPECT_TRUE(this->holds(seen, 0x11, reader)) << "a's write overtook a dropped clone's read";
  EXPECT_TRUE(this->holds(a, 0x77, owner));
}

// The same for a clone that read the shared data and then copied it to write.
TYPED_TEST(storage_test, a_stealer_waits_for_the_reads_of_a_materialized_clone_before_writing_in_place) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref owner = this->new_stream(), reader = this->new_stream(), writer = this->new_stream();
  auto a = this->filled(0x11, owner);
  auto b = lazy_clone(a, owner);
  std::atomic<bool> open{false};
  hold(dev, reader, open, 10s);
  auto seen = this->queued_copy(b, reader);
  b.record_stream(reader);
  dev.fill(writer, b.mutable_data(writer), 0x22, bytes);  // b copies on `writer`, not held
  dev.fill(owner, a.mutable_data(owner), 0x77, bytes);    // a steals and writes in place
  EXPECT_FALSE(passes_within(dev, owner, 100ms)) << "a's write did not wait for the read";
  open.store(true);
  EXPECT_TRUE(this->holds(seen, 0x11, reader)) << "a's write overtook b's read from before its copy";
  EXPECT_TRUE(this->holds(a, 0x77, owner));
  EXPECT_TRUE(this->holds(b, 0x22, writer));
}

TYPED_TEST(storage_test, memory_shared_outside_the_process_is_copied_eagerly) {
  this->make();
  auto a = this->filled(9);
  auto lazy = lazy_clone(a);
  a.mark_shared_outside_process();
  EXPECT_FALSE(a.is_lazy()) << "marking materializes first";
  EXPECT_TRUE(a.shared_outside_process());
  const auto before = this->allocations();
  auto b = lazy_clone(a);
  EXPECT_FALSE(b.is_lazy());
  EXPECT_NE(b.data(), a.data());
  EXPECT_EQ(this->allocations(), before + 1);
  EXPECT_TRUE(this->holds(b, 9));
  EXPECT_TRUE(this->holds(lazy, 9));
}

// An owner that gives its block back to the allocator and counts that it did.
class counting_owner final : public storage::storage_owner {
 public:
  counting_owner(alloc::caching_allocator& a, void* data, int& released) : a_(a), data_(data), released_(released) {}
  ~counting_owner() override {
    a_.deallocate(data_);
    ++released_;
  }

 private:
  alloc::caching_allocator& a_;
  void* data_;
  int& released_;
};

TYPED_TEST(storage_test, marking_with_a_stream_materializes_on_that_stream_and_every_later_clone_is_a_copy) {
  this->make();
  const backend::stream_ref own = this->new_stream(), producer = this->new_stream();
  auto a = this->filled(5, own);
  auto lazy = lazy_clone(a, own);  // `lazy` is used on `own` alone
  lazy.mark_shared_outside_process(producer);
  EXPECT_FALSE(lazy.is_lazy()) << "marking materializes first";
  EXPECT_EQ(lazy.last_used_on(), producer) << "the copy was made on the stream named, where the consumer waits";
  void* exported = lazy.mutable_data(producer);
  EXPECT_NE(exported, a.data()) << "the pointer taken after the mark is the storage's own";
  auto later = lazy_clone(lazy, own);
  EXPECT_FALSE(later.is_lazy()) << "a clone made after the mark is an eager copy";
  EXPECT_NE(later.data(), exported);
  EXPECT_TRUE(this->holds(lazy, 5, producer));
  EXPECT_TRUE(this->holds(later, 5, own));
}

TYPED_TEST(storage_test, try_lazy_clone_clones_what_may_be_lazily_shared_and_copies_nothing_else) {
  auto& a = this->make();
  auto plain = this->filled(3);
  auto clone = storage::try_lazy_clone(plain, {});
  ASSERT_TRUE(clone.valid());
  EXPECT_TRUE(clone.is_lazy());
  EXPECT_EQ(clone.data(), plain.data());

  auto marked = this->filled(4);
  marked.mark_shared_outside_process();
  int released = 0;
  void* p = a.allocate(bytes, {});
  auto adopted = storage_t::adopt(a, p, bytes, std::make_shared<counting_owner>(a, p, released));
  const std::size_t sizes[] = {64, 64};
  auto parts = storage_t::allocate_parts(a, sizes, {});
  const auto before = this->allocations();
  for (const storage_t* st : {&marked, &adopted, &parts[1]}) {
    const void* data = st->data();
    EXPECT_FALSE(storage::try_lazy_clone(*st, {}).valid()) << "no clone of memory that may not be lazily shared";
    EXPECT_EQ(st->data(), data) << "nor a copy: that memory stays where it is";
    EXPECT_FALSE(st->is_lazy());
  }
  EXPECT_EQ(this->allocations(), before) << "nothing was copied";
  adopted = storage_t();
  EXPECT_EQ(released, 1);
}

// The schedule a read-only export racing a write had: another thread clones
// the storage between the write's taking its pointer and enqueueing the
// write. enqueue_write makes the clone wait for the lock until the write is
// enqueued (or have come before the pointer was taken), so the clone holds
// either the data from before the write or the data written, never a write
// landing in it after it was made.
TYPED_TEST(storage_test, a_clone_racing_an_enqueued_write_comes_wholly_before_or_wholly_after_it) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref writer = this->new_stream(), other = this->new_stream();
  auto source = this->filled(1, writer);
  std::atomic<bool> open{false};
  hold(dev, writer, open, 2000ms);  // the write stays queued while the clone is made
  std::atomic<bool> clone_now{false}, cloned{false};
  storage_t clone;
  std::thread cloner([&] {
    while (!clone_now.load()) std::this_thread::yield();
    clone = storage::try_lazy_clone(source, other);  // as a read-only export does
    cloned = true;
  });
  bool cloned_in_between = false;
  source.enqueue_write(writer, [&](void* data) {
    clone_now = true;
    // Room for the clone to come in between; with the lock held it comes after.
    const auto until = std::chrono::steady_clock::now() + 200ms;
    while (!cloned.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    cloned_in_between = cloned.load();
    dev.fill(writer, data, 2, bytes);
  });
  cloner.join();
  EXPECT_FALSE(cloned_in_between) << "a clone was made between the write's pointer and its enqueue";
  ASSERT_TRUE(clone.valid());
  const std::uint8_t snapshot = cloned_in_between ? 1 : 2;
  open = true;
  EXPECT_TRUE(this->holds(clone, snapshot, other)) << "the clone's stream was not ordered after the write";
  dev.synchronize(writer);
  EXPECT_TRUE(this->holds(clone, snapshot, other)) << "the write landed in the clone's data";
  source.enqueue_write(writer, [&](void* data) { dev.fill(writer, data, 3, bytes); });
  EXPECT_TRUE(this->holds(source, 3, writer));
  EXPECT_TRUE(this->holds(clone, snapshot, other)) << "a later write moves the writer to a copy";
}

// An enqueue step that throws leaves what enqueue_write promises: the
// storage materialized away from its clone, the stream recorded as a use,
// and the lock let go (the next write goes through).
TYPED_TEST(storage_test, an_enqueue_step_that_throws_leaves_the_storage_materialized_and_its_stream_recorded) {
  auto& dev = this->device();
  this->make();
  const backend::stream_ref writer = this->new_stream(), other = this->new_stream();
  auto source = this->filled(1, other);
  auto clone = lazy_clone(source, other);
  ASSERT_TRUE(source.is_lazy());
  EXPECT_THROW(source.enqueue_write(writer, [](void*) { throw invalid_argument("refused by the test"); }),
               invalid_argument);
  EXPECT_FALSE(source.is_lazy()) << "the throw left the storage sharing its clone's data";
  EXPECT_EQ(source.last_used_on(), writer) << "the write's stream was not recorded";
  source.enqueue_write(writer, [&](void* data) { dev.fill(writer, data, 2, bytes); });
  EXPECT_TRUE(this->holds(source, 2, writer));
  EXPECT_TRUE(this->holds(clone, 1, other)) << "the clone saw the write";
}

TYPED_TEST(storage_test, adopted_memory_is_given_back_by_its_owner_once_and_copied_eagerly) {
  auto& a = this->make();
  int released = 0;
  void* p = a.allocate(bytes, {});
  this->device().fill({}, p, 4, bytes);
  {
    auto st = storage_t::adopt(a, p, bytes, std::make_shared<counting_owner>(a, p, released));
    EXPECT_TRUE(st.shared_outside_process());
    EXPECT_NE(st.owner(), nullptr);
    auto copy = lazy_clone(st, {});
    EXPECT_FALSE(copy.is_lazy()) << "adopted memory is never lazily shared";
    EXPECT_TRUE(this->holds(copy, 4));
    auto alias = st;
    st = storage_t();
    EXPECT_EQ(released, 0) << "a handle is still alive";
  }
  EXPECT_EQ(released, 1);
  EXPECT_THROW((void)storage_t::adopt(a, p, bytes, nullptr), invalid_argument);
}

TYPED_TEST(storage_test, a_taken_over_block_is_freed_once_by_its_last_handle_and_nothing_else) {
  auto& a = this->make();
  void* p = a.allocate(bytes, {});
  this->device().fill({}, p, 6, bytes);
  auto live = [&] { return a.stats().allocations.aggregate.current; };
  {
    auto st = storage_t::take_over(a, p, bytes, {});
    EXPECT_EQ(st.data(), p);
    EXPECT_EQ(st.owner(), nullptr) << "the allocator owns it, as for allocate";
    EXPECT_TRUE(this->holds(st, 6));
    EXPECT_TRUE(st.shared_outside_process()) << "its previous holder may still write it";
    auto copy = lazy_clone(st, {});
    EXPECT_FALSE(copy.is_lazy()) << "a clone of it is an eager copy";
    EXPECT_TRUE(this->holds(copy, 6));
    auto alias = st;
    st = storage_t();
    copy = storage_t();
    EXPECT_EQ(live(), 1) << "a handle is still alive";
  }
  EXPECT_EQ(live(), 0) << "the last handle freed the block";
  EXPECT_THROW((void)a.block_size(p), invalid_argument) << "freed once, and no longer live";
}

TYPED_TEST(storage_test, take_over_refuses_what_is_not_a_whole_live_block) {
  auto& a = this->make();
  void* p = a.allocate(bytes, {});
  auto* inside = static_cast<std::byte*>(p) + 512;
  EXPECT_THROW((void)storage_t::take_over(a, inside, 512, {}), invalid_argument) << "not the block's start";
  EXPECT_THROW((void)storage_t::take_over(a, p, a.block_size(p) + 1, {}), invalid_argument) << "past the block";
  EXPECT_THROW((void)storage_t::take_over(a, p, 0, {}), invalid_argument);
  EXPECT_THROW((void)storage_t::take_over(a, nullptr, bytes, {}), invalid_argument);
  a.deallocate(p, {});
  EXPECT_THROW((void)storage_t::take_over(a, p, bytes, {}), invalid_argument) << "freed already";
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
}

// A second owner would free the block under the first (and then free it
// again, perhaps as somebody else's block): the allocator's claim refuses it.
TYPED_TEST(storage_test, take_over_refuses_a_block_a_storage_owns_already) {
  auto& a = this->make();
  auto own = storage_t::allocate(a, bytes, {});
  EXPECT_THROW((void)storage_t::take_over(a, own.mutable_data({}), bytes, {}), invalid_argument)
      << "a storage's own block";
  const std::size_t sizes[] = {bytes, bytes};
  auto parts = storage_t::allocate_parts(a, sizes, {});
  EXPECT_THROW((void)storage_t::take_over(a, parts[0].mutable_data({}), bytes, {}), invalid_argument)
      << "part 0 starts the parts' block";
  auto original = storage_t::allocate(a, bytes, {});
  auto copy = lazy_clone(original);
  void* copied = copy.mutable_data({});  // materialized: a block of its own
  ASSERT_NE(copied, original.data());
  EXPECT_THROW((void)storage_t::take_over(a, copied, bytes, {}), invalid_argument)
      << "a copy-on-write copy's block";
  void* p = a.allocate(bytes, {});
  auto taken = storage_t::take_over(a, p, bytes, {});
  EXPECT_THROW((void)storage_t::take_over(a, p, bytes, {}), invalid_argument) << "taken over already";
  EXPECT_THROW(a.claim(p), invalid_argument);
  EXPECT_NO_THROW(a.check_invariants());
  EXPECT_EQ(a.stats().allocations.aggregate.current, 5) << "each block still has its one owner";
  own = storage_t();
  parts.clear();
  original = storage_t();
  copy = storage_t();
  taken = storage_t();
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
  // The claim ends with the free: the same memory handed out again is free to claim.
  void* again = a.allocate(bytes, {});
  EXPECT_NO_THROW(a.claim(again));
  a.deallocate(again, {});
}

// An owner that notes what its storages tell it.
class listening_owner final : public storage::storage_owner {
 public:
  explicit listening_owner(std::vector<backend::stream_ref>& told) : told_(told) {}
  void storage_released(std::span<const backend::stream_ref> used_on) noexcept override {
    told_.assign(used_on.begin(), used_on.end());
  }

 private:
  std::vector<backend::stream_ref>& told_;
};

TYPED_TEST(storage_test, an_owner_is_told_every_stream_its_storage_was_used_on) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref received_on = this->new_stream(), writer = this->new_stream(), reader = this->new_stream();
  void* p = a.allocate(bytes, {});
  std::vector<backend::stream_ref> told;
  {
    auto st = storage_t::adopt(a, p, bytes, std::make_shared<listening_owner>(told), received_on);
    EXPECT_EQ(st.last_used_on(), received_on);
    (void)st.mutable_data(writer);
    st.record_stream(reader);
    st.record_stream(writer);
    EXPECT_EQ(st.last_used_on(), writer);
    EXPECT_TRUE(told.empty()) << "told only when the storage goes";
  }
  const std::vector<backend::stream_ref> each_once = {received_on, writer, reader};
  EXPECT_EQ(told, each_once) << "its own stream first, then each other stream once";
  a.deallocate(p, {});
}

TYPED_TEST(storage_test, threads_recording_uses_at_once_lose_none) {
  auto& a = this->make();
  constexpr int threads = 4, streams_each = 4;
  std::vector<backend::stream_ref> streams;
  for (int i = 0; i < threads * streams_each; ++i) streams.push_back(this->new_stream());
  void* p = a.allocate(bytes, {});
  std::vector<backend::stream_ref> told;
  {
    auto st = storage_t::adopt(a, p, bytes, std::make_shared<listening_owner>(told), {});
    std::vector<std::thread> users;
    for (int t = 0; t < threads; ++t) {
      users.emplace_back([&, t] {
        for (int i = 0; i < streams_each; ++i) {
          const backend::stream_ref s = streams[static_cast<std::size_t>(t * streams_each + i)];
          if (i % 2 == 0) {
            (void)st.mutable_data(s);
          } else {
            st.record_stream(s);
          }
        }
      });
    }
    for (auto& u : users) u.join();
  }
  ASSERT_FALSE(told.empty());
  EXPECT_EQ(told.front(), backend::stream_ref{}) << "its own stream first";
  std::vector<backend::stream_ref> expected = streams;
  expected.push_back({});
  std::ranges::sort(expected);
  std::ranges::sort(told);
  EXPECT_EQ(told, expected) << "every stream once";
  a.deallocate(p, {});
}

TYPED_TEST(storage_test, a_storage_handed_over_is_freed_by_its_new_owner) {
  auto& a = this->make();
  int released = 0, made = 0;
  auto st = this->filled(6);
  auto lazy = lazy_clone(st);
  auto make = [&](void* data, std::size_t size) {
    ++made;
    EXPECT_EQ(size, bytes);
    return std::make_shared<counting_owner>(a, data, released);
  };
  auto owner = lazy.hand_over(make, {});
  EXPECT_FALSE(lazy.is_lazy()) << "materialized before it leaves";
  EXPECT_TRUE(lazy.shared_outside_process());
  EXPECT_EQ(lazy.hand_over(make, {}), owner) << "an owner is made once";
  EXPECT_EQ(made, 1);
  EXPECT_TRUE(this->holds(lazy, 6));
  owner.reset();
  lazy = storage_t();
  EXPECT_EQ(released, 1);
  EXPECT_TRUE(this->holds(st, 6)) << "the source keeps its own data";
}

TYPED_TEST(storage_test, a_block_handed_over_is_freed_after_every_stream_it_was_used_on) {
  auto& dev = this->device();
  auto& a = this->make();
  const backend::stream_ref reader = this->new_stream(), elsewhere = this->new_stream();
  int released = 0;
  auto st = this->filled(0x33);
  std::atomic<bool> open{false};
  hold(dev, reader, open, 10s);
  auto seen = this->queued_copy(st, reader);
  st.record_stream(reader);
  (void)st.hand_over([&](void* data, std::size_t) { return std::make_shared<counting_owner>(a, data, released); }, {});
  {
    backend::stream_guard on_elsewhere(dev, elsewhere);
    st = storage_t();  // the owner frees the block on `elsewhere`, the stream current here
  }
  EXPECT_EQ(released, 1);
  EXPECT_EQ(pending_frees(a), 1u) << "the block's free does not wait for the stream the storage was used on";
  open.store(true);
  dev.synchronize(reader);
  EXPECT_EQ(pending_frees(a), 0u);
  EXPECT_TRUE(this->holds(seen, 0x33, reader));
}

TYPED_TEST(storage_test, many_threads_clone_and_materialize_one_family) {
  auto& dev = this->device();
  this->make();
  constexpr int threads = 6;
  std::vector<backend::stream_ref> streams;
  for (int t = 0; t < threads; ++t) streams.push_back(this->new_stream());
  auto root = this->filled(0x40);
  std::atomic<int> wrong{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const backend::stream_ref s = streams[static_cast<std::size_t>(t)];
      for (int round = 0; round < 20; ++round) {
        auto mine = lazy_clone(root, s);
        auto grandchild = lazy_clone(mine, s);
        const auto value = static_cast<std::uint8_t>(t * 20 + round);
        dev.fill(s, mine.mutable_data(s), value, bytes);
        if (!this->holds(mine, value, s) || !this->holds(grandchild, 0x40, s)) wrong.fetch_add(1);
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_TRUE(this->holds(root, 0x40));
}

TYPED_TEST(storage_test, threads_writing_one_lazy_storage_materialize_it_once) {
  this->make();
  auto a = this->filled(0x61);
  auto b = lazy_clone(a);
  const auto before = this->allocator_->stats().allocations.aggregate.current;
  std::vector<void*> seen(4);
  std::vector<std::thread> writers;
  for (std::size_t t = 0; t < seen.size(); ++t) writers.emplace_back([&, t] { seen[t] = b.mutable_data(); });
  for (auto& w : writers) w.join();
  for (void* p : seen) EXPECT_EQ(p, seen[0]);
  // Racing writers may each allocate a block (with no lock held); one is kept.
  EXPECT_EQ(this->allocator_->stats().allocations.aggregate.current, before + 1) << "one copy, however many writers";
  EXPECT_TRUE(this->holds(b, 0x61));
}

TYPED_TEST(storage_test, random_schedules_keep_every_copy_and_release_everything_once) {
  auto& dev = this->device();
  this->make();
  std::mt19937 random(42);
  std::vector<std::pair<storage_t, std::uint8_t>> live;  // storage, the byte it must hold
  const int operations = this->on_host ? 600 : 300;
  for (int op = 0; op < operations; ++op) {
    const unsigned choice = random() % 10;
    if (live.empty() || choice < 2) {
      const auto v = static_cast<std::uint8_t>(random());
      live.emplace_back(this->filled(v), v);
    } else if (choice < 5) {  // clone
      auto& [s, v] = live[random() % live.size()];
      live.emplace_back(lazy_clone(s), v);
    } else if (choice < 7) {  // write
      auto& [s, v] = live[random() % live.size()];
      v = static_cast<std::uint8_t>(random());
      dev.fill({}, s.mutable_data(), v, bytes);
    } else if (choice < 9) {  // check
      auto& [s, v] = live[random() % live.size()];
      ASSERT_TRUE(this->holds(s, v)) << "operation " << op;
    } else {  // drop
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(random() % live.size()));
    }
  }
  for (auto& [s, v] : live) ASSERT_TRUE(this->holds(s, v));
  live.clear();
  dev.synchronize({});
  this->allocator_->empty_cache();
  const auto st = this->allocator_->stats();
  EXPECT_TRUE(nothing_in_use(st));
  EXPECT_EQ(st.reserved_bytes.aggregate.current, 0);
}

TYPED_TEST(storage_unsafe_test, a_clone_is_freed_after_the_stream_it_was_made_for_with_safety_off) {
  auto& dev = this->device();
  auto& alloc = this->make();
  const backend::stream_ref own = this->new_stream(), clone_on = this->new_stream();
  auto src = this->filled(0x21, own);
  const void* shared = src.data();
  auto c = lazy_clone(src, clone_on);
  std::atomic<bool> open{false};
  hold(dev, clone_on, open, 10s);
  src = storage_t();
  c = storage_t();  // the family's last handle: the data is freed while clone_on still runs
  EXPECT_EQ(pending_frees(alloc), 1u) << "the shared data was freed before the clone's stream passed";
  auto next = storage_t::allocate(alloc, bytes, own);
  EXPECT_NE(next.data(), shared);
  open.store(true);
  dev.synchronize(clone_on);
}

TYPED_TEST(storage_unsafe_test, a_stealer_is_freed_after_its_own_stream_with_safety_off) {
  auto& dev = this->device();
  auto& alloc = this->make();
  const backend::stream_ref own = this->new_stream(), writer = this->new_stream();
  auto src = this->filled(0x31, own);
  const void* shared = src.data();
  auto c = lazy_clone(src, writer);
  src = storage_t();
  EXPECT_EQ(c.mutable_data(writer), shared) << "the last reference steals";
  std::atomic<bool> open{false};
  hold(dev, writer, open, 10s);
  c = storage_t();
  EXPECT_EQ(pending_frees(alloc), 1u) << "the stolen block was freed before the stealer's stream passed";
  auto next = storage_t::allocate(alloc, bytes, own);
  EXPECT_NE(next.data(), shared);
  open.store(true);
  dev.synchronize(writer);
}

}  // namespace
}  // namespace shoal::testing
