// A storage allocates with no lock of its own held (a materializing copy, an
// eager clone): the allocator's out-of-memory observers and cache-miss hooks
// may use the very storage whose allocation they interrupt, from any thread,
// and other threads may materialize it meanwhile — exactly one copy is kept
// and no block is lost. (With the storage's lock held across the allocation,
// an observer's use of the storage waited for that lock while the lock's
// holder waited for the observer: in Python, a thread holding the GIL waited
// for a storage that an observer of another thread, waiting for the GIL, had
// locked.) Each use from another thread is waited for with a deadline, so a
// regression fails the test instead of hanging it.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/storage/storage.h"
#include "support/allocators.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using storage::lazy_clone;
using storage_t = storage::storage;
constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t bytes = 12 * mib;  // a segment of its own: each allocation of it misses the cache
constexpr auto deadline = 20s;           // a regression deadlocks: any deadline finds it

// Runs `use` on a thread of its own and tells whether it ended within the
// deadline; the thread is joined by the caller's finish() whatever happened.
class use_elsewhere {
 public:
  template <class Use>
  bool ran_in_time(Use use) {
    std::promise<void> done;
    auto ended = done.get_future();
    thread_ = std::thread([use, done = std::move(done)]() mutable {
      use();
      done.set_value();
    });
    return ended.wait_for(deadline) == std::future_status::ready;
  }
  void finish() {
    if (thread_.joinable()) thread_.join();
  }
  ~use_elsewhere() { finish(); }

 private:
  std::thread thread_;
};

// A cache-miss hook, removed as this goes (before the locals it uses, made earlier).
class miss_hook {
 public:
  miss_hook(alloc::caching_allocator& a, std::function<void()> hook)
      : allocator_(a), id_(a.add_cache_miss_hook(std::move(hook))) {}
  miss_hook(const miss_hook&) = delete;
  miss_hook& operator=(const miss_hook&) = delete;
  ~miss_hook() { allocator_.remove_hook(id_); }

 private:
  alloc::caching_allocator& allocator_;
  const std::uint64_t id_;
};

template <class Param>
class storage_allocation_unlocked : public allocator_test<Param> {
 protected:
  storage_t filled(std::uint8_t value, backend::stream_ref s) {
    auto st = storage_t::allocate(*this->allocator_, bytes, s);
    this->device().fill(s, st.mutable_data(s), value, bytes);
    return st;
  }
  bool holds(const storage_t& st, std::uint8_t value, backend::stream_ref s) {
    std::vector<std::uint8_t> out(st.size());
    this->device().copy(s, out.data(), st.data(), st.size());
    this->device().synchronize(s);
    return std::ranges::all_of(out, [value](std::uint8_t b) { return b == value; });
  }
  /// An out-of-memory observer of `a` that, when first called, runs `use` on
  /// another thread; observed() counts its calls, used_in_time() tells whether
  /// `use` ended within the deadline.
  template <class Use>
  void observe_with(alloc::caching_allocator& a, Use use) {
    a.add_oom_observer([this, use](const alloc::oom_report&) {
      if (observed_++ > 0) return;
      in_time_ = elsewhere_.ran_in_time(use);
    });
  }
  int observed() const { return observed_.load(); }
  bool used_in_time() {
    elsewhere_.finish();
    return in_time_;
  }
  /// Blocks in use once the stream has passed what was enqueued.
  std::int64_t in_use(backend::stream_ref s) {
    this->device().synchronize(s);
    this->allocator_->process_pending_frees();
    return this->allocator_->stats().allocations.aggregate.current;
  }

 private:
  use_elsewhere elsewhere_;
  std::atomic<int> observed_{0};
  bool in_time_ = false;
};
TYPED_TEST_SUITE(storage_allocation_unlocked, backend_config_types, backend_config_names);

TYPED_TEST(storage_allocation_unlocked, an_oom_observer_may_use_the_clone_whose_copy_ran_out_of_memory) {
  auto& a = this->make("memory_limit_mb:40");
  backend::stream own(this->device()), other(this->device());
  auto source = this->filled(0xAB, own.ref());
  auto clone = lazy_clone(source, own.ref());
  auto filler = storage_t::allocate(a, 2 * bytes, own.ref());  // 36 of 40 MiB: no room for the copy
  this->observe_with(a, [&] {
    EXPECT_FALSE(clone.shared_outside_process());
    clone.record_stream(other.ref());
    (void)lazy_clone(clone, other.ref());  // dropped at once
  });
  EXPECT_THROW((void)clone.mutable_data(own.ref()), out_of_memory);
  EXPECT_TRUE(this->used_in_time()) << "the observer's use of the clone waited for the lock its allocation held";
  EXPECT_EQ(this->observed(), 1);
  EXPECT_TRUE(clone.is_lazy()) << "a copy that ran out of memory changes nothing";
  EXPECT_EQ(this->in_use(own.ref()), 2) << "a block was lost or kept";
  filler = storage_t();
  this->device().fill(own.ref(), clone.mutable_data(own.ref()), 0xCD, bytes);
  EXPECT_TRUE(this->holds(source, 0xAB, own.ref()));
  EXPECT_TRUE(this->holds(clone, 0xCD, own.ref()));
}

TYPED_TEST(storage_allocation_unlocked, an_oom_observer_may_use_the_storage_whose_eager_clone_ran_out_of_memory) {
  auto& a = this->make("memory_limit_mb:40");
  backend::stream own(this->device()), other(this->device());
  auto source = this->filled(0xAB, own.ref());
  source.mark_shared_outside_process(own.ref());  // its clones are eager copies
  auto filler = storage_t::allocate(a, 2 * bytes, own.ref());
  this->observe_with(a, [&] {
    EXPECT_TRUE(source.shared_outside_process());
    source.record_stream(other.ref());
  });
  EXPECT_THROW((void)lazy_clone(source, own.ref()), out_of_memory);
  EXPECT_TRUE(this->used_in_time()) << "the observer's use of the source waited for the lock of its clone's allocation";
  EXPECT_EQ(this->in_use(own.ref()), 2);
  filler = storage_t();
  auto copy = lazy_clone(source, own.ref());
  EXPECT_FALSE(copy.is_lazy());
  EXPECT_TRUE(this->holds(copy, 0xAB, own.ref()));
}

// While one thread allocates its copy, another materializes the same clone:
// the first finds it done, gives its block back and writes to the same data.
TYPED_TEST(storage_allocation_unlocked,
           a_materialization_by_another_thread_during_the_copys_allocation_leaves_one_copy) {
  auto& a = this->make();
  backend::stream own(this->device());
  auto source = this->filled(0xAB, own.ref());
  auto clone = lazy_clone(source, own.ref());
  use_elsewhere elsewhere;
  std::atomic<bool> hooked{false};
  bool in_time = false;
  void* theirs = nullptr;
  const miss_hook hook(a, [&] {
    if (hooked.exchange(true)) return;  // the other thread's own miss
    in_time = elsewhere.ran_in_time([&] { theirs = clone.mutable_data(own.ref()); });
  });
  void* ours = clone.mutable_data(own.ref());
  elsewhere.finish();
  EXPECT_TRUE(in_time) << "the other thread waited for the lock the first one's allocation held";
  EXPECT_EQ(ours, theirs) << "two copies of one clone";
  EXPECT_NE(ours, source.data());
  EXPECT_FALSE(clone.is_lazy());
  EXPECT_EQ(this->in_use(own.ref()), 2) << "the first thread's block was kept (or the copy lost)";
  EXPECT_TRUE(this->holds(clone, 0xAB, own.ref()));
}

// Memory for one copy only: a writer whose allocation fails because another
// writer's copy took the room writes to that copy instead of failing.
TYPED_TEST(storage_allocation_unlocked, a_writer_left_no_memory_by_another_writers_copy_writes_to_that_copy) {
  auto& a = this->make("memory_limit_mb:40");
  backend::stream own(this->device());
  auto source = this->filled(0xAB, own.ref());
  auto clone = lazy_clone(source, own.ref());
  auto filler = storage_t::allocate(a, bytes, own.ref());  // 24 of 40 MiB: room for one copy
  use_elsewhere elsewhere;
  std::atomic<bool> hooked{false};
  bool in_time = false;
  void* theirs = nullptr;
  const miss_hook hook(a, [&] {
    if (hooked.exchange(true)) return;
    in_time = elsewhere.ran_in_time([&] { theirs = clone.mutable_data(own.ref()); });
  });
  void* ours = nullptr;
  EXPECT_NO_THROW(ours = clone.mutable_data(own.ref())) << "out of memory although the clone has a copy";
  elsewhere.finish();
  EXPECT_TRUE(in_time);
  EXPECT_EQ(ours, theirs);
  EXPECT_EQ(this->in_use(own.ref()), 3);
  EXPECT_TRUE(this->holds(clone, 0xAB, own.ref()));
}

// No memory for a copy, and the family's other member goes during the failed
// allocation: the clone, the last holder now, takes the data over instead of
// failing.
TYPED_TEST(storage_allocation_unlocked, a_writer_left_no_memory_whose_family_went_meanwhile_takes_the_data_over) {
  auto& a = this->make("memory_limit_mb:40");
  backend::stream own(this->device());
  auto source = this->filled(0xAB, own.ref());
  const void* shared = source.data();
  auto clone = lazy_clone(source, own.ref());
  auto filler = storage_t::allocate(a, 2 * bytes, own.ref());  // 36 of 40 MiB: no room for the copy
  const miss_hook hook(a, [&] { source = storage_t(); });       // the shared data stays: the clone holds it
  void* ours = nullptr;
  EXPECT_NO_THROW(ours = clone.mutable_data(own.ref())) << "out of memory although the clone is the last holder";
  EXPECT_EQ(ours, shared);
  EXPECT_FALSE(clone.is_lazy());
  EXPECT_EQ(this->in_use(own.ref()), 2);
  EXPECT_TRUE(this->holds(clone, 0xAB, own.ref()));
}

// While the copy's block is allocated, the family's other member goes: the
// clone is the last holder then, and takes the data over instead of copying.
TYPED_TEST(storage_allocation_unlocked, a_clone_left_alone_during_the_copys_allocation_takes_the_data_over) {
  auto& a = this->make();
  backend::stream own(this->device());
  auto source = this->filled(0xAB, own.ref());
  const void* shared = source.data();
  auto clone = lazy_clone(source, own.ref());
  const miss_hook hook(a, [&] { source = storage_t(); });
  void* ours = clone.mutable_data(own.ref());
  EXPECT_EQ(ours, shared) << "copied although it was the last holder";
  EXPECT_FALSE(clone.is_lazy());
  EXPECT_EQ(this->in_use(own.ref()), 1) << "the block allocated for the copy was kept";
  EXPECT_TRUE(this->holds(clone, 0xAB, own.ref()));
}

// A clone made while an enqueued write allocates its copy (the storage's
// lock let go) keeps the data it had: the write, enqueued once the lock is
// taken again, goes to the copy, though the writer was about to be the last
// holder when the allocation began.
TYPED_TEST(storage_allocation_unlocked, a_clone_made_while_an_enqueued_write_allocates_its_copy_keeps_its_data) {
  auto& a = this->make();
  backend::stream own(this->device());
  auto source = this->filled(0xAB, own.ref());
  auto writer = lazy_clone(source, own.ref());
  use_elsewhere elsewhere;
  std::atomic<bool> hooked{false};
  bool in_time = false;
  storage_t theirs;
  const miss_hook hook(a, [&] {
    if (hooked.exchange(true)) return;
    in_time = elsewhere.ran_in_time([&] {
      source = storage_t();                                 // the writer would hold the data alone,
      theirs = storage::try_lazy_clone(writer, own.ref());  // but for this clone
    });
  });
  writer.enqueue_write(own.ref(), [&](void* data) { this->device().fill(own.ref(), data, 0xCD, bytes); });
  elsewhere.finish();
  EXPECT_TRUE(in_time) << "the clone waited for the lock the write's allocation held";
  ASSERT_TRUE(theirs.valid());
  EXPECT_TRUE(this->holds(theirs, 0xAB, own.ref())) << "the write landed in the clone's data";
  EXPECT_TRUE(this->holds(writer, 0xCD, own.ref()));
  EXPECT_EQ(this->in_use(own.ref()), 2) << "the copy's block was lost or one too many kept";
}

}  // namespace
}  // namespace shoal::testing
