// The background transfer engine on both backends: bytes and order, the
// seed race through the engine (and its unsafe control), sources held only
// as long as needed, backpressure bounds, failed batches, and nothing left
// allocated at the end.
#include "shoal/transfer/transfer_engine.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <limits>
#include <string>
#include <thread>

#include "shoal/core/error.h"
#include "support/backends.h"
#include "support/host_buffers.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using transfer::host_buffer;
using transfer::transfer_config;
using transfer::transfer_engine;
constexpr std::size_t kib = 1024, mib = kib * kib;

std::uint8_t pattern(std::uint64_t i) { return static_cast<std::uint8_t>(0x10 + i % 200); }

// The most bytes of blocks allocated at once, from the allocator's trace.
// stats()'s aggregate peak is the sum of each pool's own peak, an upper bound
// when the pools peak at different moments (groups of one to three batches
// here come from the small pool, four from the large one). A free is noted
// under its pool's lock and after its allocation's note, which may come
// late: the peak seen here is never above the real one.
std::int64_t peak_allocated_bytes(const std::vector<alloc::trace_entry>& trace) {
  std::int64_t current = 0, peak = 0;
  for (const alloc::trace_entry& e : trace) {
    if (e.action == alloc::trace_action::alloc) current += static_cast<std::int64_t>(e.size);
    if (e.action == alloc::trace_action::free_requested) current -= static_cast<std::int64_t>(e.size);
    peak = std::max(peak, current);
  }
  return peak;
}

template <class Backend>
class transfer_engine_test : public backend_test<Backend> {
 public:
  alloc::caching_allocator& make_allocator(std::string_view conf = "") {
    allocator_.reset();
    copy_stream_ = std::make_unique<stream>(this->device());
    consumer_ = std::make_unique<stream>(this->device());
    other_consumer_ = std::make_unique<stream>(this->device());
    allocator_ = std::make_unique<alloc::caching_allocator>(this->device(), alloc::allocator_config::parse(conf));
    return *allocator_;
  }
  /// The engine's copy stream and two consumers' streams: made before the
  /// allocator, gone after it (transfer_engine.h, Lifetimes).
  backend::stream_ref copy_stream() const { return copy_stream_->ref(); }
  backend::stream_ref consumer() const { return consumer_->ref(); }
  backend::stream_ref other_consumer() const { return other_consumer_->ref(); }

 protected:
  void TearDown() override {
    if (allocator_ == nullptr) return;
    EXPECT_EQ(allocator_->stats().allocations.aggregate.current, 0) << "device storages left allocated";
    allocator_.reset();
  }
  std::unique_ptr<stream> copy_stream_, consumer_, other_consumer_;
  std::unique_ptr<alloc::caching_allocator> allocator_;
};
TYPED_TEST_SUITE(transfer_engine_test, backend_types, backend_names);

TYPED_TEST(transfer_engine_test, batches_arrive_in_submission_order_with_every_byte) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  transfer_engine engine(a, this->copy_stream(),
                         {.max_batches_in_flight = 3, .max_pinned_bytes = 2 * mib, .staging_chunk_bytes = 256 * kib});
  const backend::stream_ref consumer = this->consumer();
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < 12; ++i) {
      // Two buffers: one staged in several chunks, one small.
      engine.submit({pageable(mib + 123, pattern(i)), pageable(100, pattern(i + 1))});
    }
  });
  for (std::uint64_t i = 0; i < 12; ++i) {
    auto batch = engine.next(10s);
    EXPECT_EQ(batch.sequence(), i);
    ASSERT_EQ(batch.storages().size(), 2u);
    batch.wait_on(consumer);
    EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), mib + 123, consumer), pattern(i)));
    EXPECT_TRUE(all_equal(this->read(batch.storages()[1].data(), 100, consumer), pattern(i + 1)));
  }
  producer.join();
  const auto s = engine.stats();
  EXPECT_EQ(s.batches_submitted, 12u);
  EXPECT_EQ(s.batches_transferred, 12u);
  EXPECT_EQ(s.batches_taken, 12u);
  EXPECT_EQ(s.in_flight, 0u);
  EXPECT_EQ(s.bytes_copied, 12u * (mib + 123 + 100));
  EXPECT_EQ(s.bytes_staged, s.bytes_copied);
}

// The seed scenario: the consumer enqueues a slow read of each batch on its
// own stream and drops the batch at once, while the engine keeps producing
// into freshly freed memory. `record_use` false is the unsafe control: the
// consumer's stream waits for the copies but the storages never learn of it.
// `coalesce`: the engine's stream stalls before every fourth batch, so the
// engine's thread waits for room on it while batches queue, and takes them
// in groups (checked); otherwise each batch goes alone. `two_streams`: the
// batches are read on two consumer streams in turn, so the storages of one
// group (parts of one device block) are dropped with reads queued on both.
template <class Test>
int corrupted_batches(Test& test, bool record_use, bool coalesce, bool two_streams = false) {
  auto& dev = test.device();
  auto& a = test.make_allocator();
  transfer_engine engine(a, test.copy_stream(),
                         {.max_batches_in_flight = 4, .max_coalesced_bytes = coalesce ? 4 * mib : 0});
  constexpr std::uint64_t batches = 16;
  constexpr std::size_t bytes = 256 * kib;
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < batches; ++i) {
      if (coalesce && i % 4 == 0) dev.delay(engine.stream(), 30ms);
      engine.submit({pageable(bytes, pattern(i))});
    }
  });
  // Pinned, so that the reads are asynchronous on CUDA too (a copy into
  // pageable memory returns only once it has run, which would serialize the
  // consumer with its stream and hide the race).
  auto* seen = static_cast<std::uint8_t*>(dev.allocate_pinned_host(batches * bytes));
  for (std::uint64_t i = 0; i < batches; ++i) {
    auto batch = engine.next(10s);
    const backend::stream_ref model = two_streams && i % 2 == 1 ? test.other_consumer() : test.consumer();
    if (record_use) {
      batch.wait_on(model);
    } else {
      dev.wait(model, batch.ready());
    }
    dev.delay(model, 20ms);  // the model is busy before it reads the batch
    dev.copy(model, seen + i * bytes, batch.storages()[0].data(), bytes);
  }  // each batch dropped right after its read was enqueued
  producer.join();
  dev.synchronize(test.consumer());
  dev.synchronize(test.other_consumer());
  int corrupted = 0;
  for (std::uint64_t i = 0; i < batches; ++i) {
    corrupted += all_equal(std::vector<std::uint8_t>(seen + i * bytes, seen + (i + 1) * bytes), pattern(i)) ? 0 : 1;
  }
  dev.free_pinned_host(seen);
  const auto s = engine.stats();
  if (coalesce) {
    EXPECT_LT(s.coalesced_groups, batches) << "no batches were coalesced: the test would prove nothing about groups";
  } else {
    EXPECT_EQ(s.coalesced_groups, batches);
  }
  return corrupted;
}

TYPED_TEST(transfer_engine_test, a_batch_dropped_while_its_read_is_queued_is_never_overwritten) {
  EXPECT_EQ(corrupted_batches(*this, true, false), 0);
}

TYPED_TEST(transfer_engine_test, a_coalesced_batch_dropped_while_its_read_is_queued_is_never_overwritten) {
  EXPECT_EQ(corrupted_batches(*this, true, true), 0);
}

TYPED_TEST(transfer_engine_test, coalesced_batches_dropped_while_read_on_two_streams_are_never_overwritten) {
  EXPECT_EQ(corrupted_batches(*this, true, true, true), 0);
}

TYPED_TEST(transfer_engine_test, control_without_the_use_recorded_the_engine_overwrites_batches_still_being_read) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a real data race between two streams, on purpose: not under ThreadSanitizer";
#endif
  EXPECT_GT(corrupted_batches(*this, false, false), 0) << "the race did not show: the safe test would prove nothing";
  EXPECT_GT(corrupted_batches(*this, false, true), 0)
      << "the race did not show with groups: the safe test would prove nothing";
  EXPECT_GT(corrupted_batches(*this, false, true, true), 0)
      << "the race did not show with groups read on two streams: the safe test would prove nothing";
}

// A 64 KiB source in pinned host memory of an allocator of its own, filled
// with 0x5A: the engine copies it directly, with no staging.
struct pinned_source {
  pinned_source(backend::device& dev, backend::stream_ref stream)
      : memory(dev, alloc::allocator_config::parse("memory:pinned_host")),
        stream(stream),
        block(memory.allocate(64 * kib, stream)) {
    std::memset(block, 0x5A, 64 * kib);
  }
  ~pinned_source() { memory.deallocate(block, stream); }
  pinned_source(const pinned_source&) = delete;
  pinned_source& operator=(const pinned_source&) = delete;

  alloc::caching_allocator memory;
  backend::stream_ref stream;
  void* block;
};

TYPED_TEST(transfer_engine_test, a_pinned_source_is_held_until_the_copy_reading_it_has_run) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  const backend::stream_ref s = this->consumer();
  pinned_source source(dev, s);
  void* block = source.block;
  transfer_engine engine(a, this->copy_stream());
  std::atomic<bool> released{false};
  std::shared_ptr<const void> keep(block, [&](const void*) { released = true; });
  dev.delay(engine.stream(), 200ms);  // the engine's copies run late
  engine.submit({host_buffer{block, 64 * kib, true, std::move(keep)}});
  auto batch = engine.next(10s);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(released) << "the source was let go while the copy reading it was still queued";
  batch.synchronize();
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!released && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(released) << "the source is let go once its copy has run";
  batch.wait_on(s);
  EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 64 * kib, s), 0x5A));
  EXPECT_EQ(engine.stats().bytes_staged, 0u) << "a pinned source is copied directly";
}

// A source's owner may need something that another thread holds while that
// thread waits for the engine's lock: in Python, the GIL, held through
// stats(). Here the source's deleter asks another thread for stats() and
// waits (at most 2 s) for the answer, which never comes while the deleter
// runs under the engine's lock.
TYPED_TEST(transfer_engine_test, a_source_is_let_go_outside_the_engines_lock) {
  auto& a = this->make_allocator();
  const backend::stream_ref s = this->consumer();
  pinned_source source(this->device(), s);
  void* block = source.block;
  transfer_engine engine(a, this->copy_stream());
  std::promise<bool> answered_in_deleter;  // whether stats() answered while the deleter waited
  std::atomic<bool> gave_up{false};         // the test ended first: the deleter asks nothing
  std::thread asker;
  std::shared_ptr<const void> keep(block, [&](const void*) {
    if (gave_up) return;
    auto answered = std::make_shared<std::promise<void>>();
    auto answer = answered->get_future();
    asker = std::thread([&engine, answered] {
      (void)engine.stats();
      answered->set_value();
    });
    answered_in_deleter.set_value(answer.wait_for(2s) == std::future_status::ready);
  });
  engine.submit({host_buffer{block, 64 * kib, true, std::move(keep)}});
  auto batch = engine.next(10s);
  batch.synchronize();
  auto result = answered_in_deleter.get_future();
  if (result.wait_for(10s) != std::future_status::ready) {
    gave_up = true;
    FAIL() << "the source was not let go within 10 s of its copy";
  }
  asker.join();
  EXPECT_TRUE(result.get()) << "the source's deleter ran under the engine's lock: stats() waited for it";
  batch.wait_on(s);
  EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 64 * kib, s), 0x5A));
}

// A fast producer of `bytes`-byte batches against a slow consumer, at most
// `in_flight` batches in flight (max_batches_in_flight, or fewer when
// `bytes_in_flight` bounds them first). The engine's copies wait behind a
// stall at first: the first `in_flight` batches fill its stream's queue, so
// the engine's thread waits for room on the stream with the next batch while
// the consumer takes those and the producer queues up more (with
// `in_flight` > 2 several more: they are taken as one group).
template <class Test>
void stays_within_bounds(Test& test, std::size_t bytes, std::size_t max_batches, bool coalesced,
                         std::size_t bytes_in_flight = transfer_config{}.max_bytes_in_flight) {
  auto& dev = test.device();
  auto& a = test.make_allocator("trace_entries:10000");  // for peak_allocated_bytes
  const transfer_config config{.max_batches_in_flight = max_batches,
                               .max_bytes_in_flight = bytes_in_flight,
                               .max_pinned_bytes = 4 * mib,
                               .staging_chunk_bytes = mib};
  const std::size_t in_flight = std::min(max_batches, std::max<std::size_t>(1, bytes_in_flight / bytes));
  transfer_engine engine(a, test.copy_stream(), config);
  dev.delay(engine.stream(), 100ms);
  for (std::size_t i = 0; i < in_flight; ++i) engine.submit({pageable(bytes, 1)});
  EXPECT_THROW(engine.submit({pageable(bytes, 3)}, 50ms), timeout_error) << "one batch more than may be in flight";
  const backend::stream_ref consumer = test.consumer();
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < 20; ++i) engine.submit({pageable(bytes, pattern(i))});
  });
  const std::size_t batches = in_flight + 20;
  for (std::size_t i = 0; i < batches; ++i) {
    auto batch = engine.next(10s);
    batch.wait_on(consumer);
    dev.delay(consumer, 5ms);  // a slow consumer
  }
  producer.join();
  dev.synchronize(consumer);
  const auto s = engine.stats();
  EXPECT_LE(s.peak_in_flight, in_flight);
  EXPECT_LE(s.peak_bytes_in_flight, in_flight * bytes);
  EXPECT_LE(s.pinned.reserved_bytes.aggregate.peak, static_cast<std::int64_t>(config.max_pinned_bytes));
  EXPECT_EQ(s.bytes_staged, batches * bytes);
  // Device memory held by batches' storages: those in flight (transferred or
  // being transferred, not taken) and the one the consumer holds, each with
  // its group's block: the batches of the consumer's group it dropped already
  // (fewer than `in_flight`) are freed with the group's last. Storages dropped
  // and waiting for the consumer's stream are no longer held (the consumer's
  // own pace bounds those).
  const auto trace = a.trace();
  ASSERT_LT(trace.size(), 10000u) << "the trace lost its oldest entries";
  EXPECT_LE(peak_allocated_bytes(trace), static_cast<std::int64_t>(2 * in_flight * bytes));
  if (coalesced) {
    EXPECT_LT(s.coalesced_groups, batches) << "no batches were coalesced: the test would prove nothing about groups";
  } else {
    EXPECT_EQ(s.coalesced_groups, batches);
  }
}

TYPED_TEST(transfer_engine_test, a_fast_producer_stays_within_the_batch_and_pinned_bounds) {
  // Staged chunk by chunk, each batch alone (past max_coalesced_bytes together).
  stays_within_bounds(*this, 3 * mib, 2, false);
}

TYPED_TEST(transfer_engine_test, a_fast_producer_of_small_batches_stays_within_the_bounds_when_they_are_coalesced) {
  // Packed into shared staging blocks, up to four batches a group.
  stays_within_bounds(*this, 300 * kib, 4, true);
}

TYPED_TEST(transfer_engine_test, a_fast_producer_stays_within_the_byte_bound_when_it_is_reached_first) {
  // Sixteen batches may be in flight, but only three of them fit in 1 MiB.
  stays_within_bounds(*this, 300 * kib, 16, true, mib);
}

// Past the byte bound two batches may still be in flight, so a loop that
// submits one ahead of taking the last, on one thread, never waits on itself.
TYPED_TEST(transfer_engine_test, batches_larger_than_the_byte_bound_go_two_at_a_time) {
  auto& a = this->make_allocator();
  transfer_engine engine(a, this->copy_stream(), {.max_bytes_in_flight = mib});
  engine.submit({pageable(2 * mib, 1)});
  for (std::uint8_t i = 2; i <= 4; ++i) {
    engine.submit({pageable(2 * mib, i)}, 10s);  // one ahead: with the one not yet taken, two in flight
    EXPECT_THROW(engine.submit({pageable(64 * kib, 9)}, 50ms), timeout_error) << "a third would pass the bound";
    auto batch = engine.next(10s);
    batch.wait_on(this->consumer());
    EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 2 * mib, this->consumer()), i - 1));
  }
  (void)engine.next(10s);
  const auto s = engine.stats();
  EXPECT_EQ(s.peak_in_flight, 2u);
  EXPECT_EQ(s.peak_bytes_in_flight, 4 * mib);
  EXPECT_EQ(s.bytes_in_flight, 0u);
  EXPECT_THROW(transfer_engine(a, this->copy_stream(), {.max_bytes_in_flight = 0}), invalid_argument);
}

// The default ring (max_pinned_bytes) is smaller than a large buffer: the
// buffer goes through it chunk by chunk, each block rewritten only after the
// copy that read it, whichever stores write it.
TYPED_TEST(transfer_engine_test, a_buffer_larger_than_the_staging_ring_arrives_whole_with_each_kind_of_store) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  const std::size_t bytes = transfer_config{}.max_pinned_bytes + 5 * mib + 17;
  for (auto stores : {transfer_config::stores::streaming, transfer_config::stores::cached, transfer_config::stores::automatic}) {
    transfer_engine engine(a, this->copy_stream(), {.staging_stores = stores});
    const backend::stream_ref consumer = this->consumer();
    // Each chunk of the buffer holds its own value, so a ring block handed
    // out again before its copy ran would show as another chunk's bytes.
    auto data = std::make_shared<std::vector<std::uint8_t>>(bytes);
    const std::size_t chunk = transfer_config{}.staging_chunk_bytes;
    for (std::size_t i = 0; i < bytes; ++i) (*data)[i] = pattern(i / chunk);
    dev.delay(engine.stream(), 20ms);  // copies lag behind staging
    engine.submit({host_buffer{data->data(), bytes, false, data}});
    auto batch = engine.next(30s);
    batch.wait_on(consumer);
    EXPECT_EQ(this->read(batch.storages()[0].data(), bytes, consumer), *data) << static_cast<int>(stores);
    const auto s = engine.stats();
    EXPECT_LE(s.pinned.reserved_bytes.aggregate.peak, static_cast<std::int64_t>(transfer_config{}.max_pinned_bytes));
    EXPECT_EQ(s.bytes_staged, bytes);
  }
}

TYPED_TEST(transfer_engine_test, a_batch_that_cannot_be_transferred_fails_alone) {
  auto& dev = this->device();
  auto& a = this->make_allocator("memory_limit_mb:8");
  const backend::stream_ref s = this->consumer();
  transfer_engine engine(a, this->copy_stream());
  engine.submit({pageable(64 * kib, 1), pageable(16 * mib, 2)});  // past the device allocator's limit
  engine.submit({pageable(64 * kib, 3)});
  EXPECT_THROW((void)engine.next(10s), out_of_memory);
  auto batch = engine.next(10s);
  EXPECT_EQ(batch.sequence(), 1u);
  batch.wait_on(s);
  EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 64 * kib, s), 3));
  const auto stats = engine.stats();
  EXPECT_EQ(stats.batches_failed, 1u);
  EXPECT_EQ(stats.batches_transferred, 1u);
  EXPECT_EQ(stats.in_flight, 0u);
}

TYPED_TEST(transfer_engine_test, take_hands_back_a_failed_batchs_error_with_its_sequence) {
  auto& a = this->make_allocator("memory_limit_mb:8");
  transfer_engine engine(a, this->copy_stream());
  engine.submit({pageable(64 * kib, 1)});
  engine.submit({pageable(16 * mib, 2)});  // past the device allocator's limit
  engine.submit({pageable(64 * kib, 3)});
  auto first = engine.take(10s);
  EXPECT_EQ(first.sequence, 0u);
  EXPECT_TRUE(first.batch.has_value() && first.error == nullptr);
  auto failed = engine.take(10s);
  EXPECT_EQ(failed.sequence, 1u) << "the failed batch is named";
  EXPECT_FALSE(failed.batch.has_value());
  ASSERT_NE(failed.error, nullptr);
  EXPECT_THROW(std::rethrow_exception(failed.error), out_of_memory);
  auto last = engine.take(10s);
  EXPECT_EQ(last.sequence, 2u);
  ASSERT_TRUE(last.batch.has_value());
  EXPECT_EQ(last.batch->sequence(), 2u);
  EXPECT_EQ(engine.stats().batches_taken, 3u);
  EXPECT_THROW((void)engine.take(10ms), timeout_error);
}

TYPED_TEST(transfer_engine_test, each_batchs_tag_comes_back_with_it_failed_or_not_and_the_rest_go_with_the_engine) {
  auto& a = this->make_allocator("memory_limit_mb:8");
  std::atomic<int> let_go{0};
  // A tag whose end is counted: the engine must let go of each exactly once.
  const auto tag = [&](int value) {
    return std::shared_ptr<const void>(new int(value), [&](const void* p) {
      delete static_cast<const int*>(p);
      ++let_go;
    });
  };
  const auto value_of = [](const std::shared_ptr<const void>& t) { return *static_cast<const int*>(t.get()); };
  {
    transfer_engine engine(a, this->copy_stream(), {.max_coalesced_bytes = 64 * mib});
    engine.submit({pageable(64 * kib, 1)}, transfer_engine::forever, tag(10));
    engine.submit({pageable(16 * mib, 2)}, transfer_engine::forever, tag(11));  // past the limit: fails
    engine.submit({pageable(64 * kib, 3)}, transfer_engine::forever, tag(12));
    engine.submit({pageable(64 * kib, 4)});  // no tag
    engine.submit({pageable(64 * kib, 5)}, transfer_engine::forever, tag(14));  // never taken
    for (int i = 0; i < 4; ++i) {
      auto taken = engine.take(10s);
      EXPECT_EQ(taken.sequence, static_cast<std::uint64_t>(i));
      if (i == 3) {
        EXPECT_EQ(taken.tag, nullptr);
        continue;
      }
      ASSERT_NE(taken.tag, nullptr) << "batch " << i;
      EXPECT_EQ(value_of(taken.tag), 10 + i) << "a batch came back with another's tag";
      EXPECT_EQ(taken.error != nullptr, i == 1);
    }
    EXPECT_EQ(let_go, 3) << "a taken batch's tag was kept by the engine";
  }
  EXPECT_EQ(let_go, 4) << "the tag of a batch never taken outlived the engine";
}

// Holds the engine's thread before the test submits: one batch a chunk
// larger than the staging ring, its copies behind `stall` on the engine's
// stream. Once the ring is full (awaited here) the thread is inside that
// batch, waiting for a block until the stall has run, so the batches
// submitted meanwhile queue up and are taken after it as one group (their
// buffers made before: filling large ones takes long under ThreadSanitizer).
constexpr transfer_config small_ring{.max_batches_in_flight = 8,
                                     .max_pinned_bytes = 4 * mib,
                                     .staging_chunk_bytes = mib,
                                     .max_coalesced_bytes = 64 * mib};
template <class Test>
void hold_the_engine_thread(Test& test, transfer_engine& engine, std::chrono::milliseconds stall) {
  host_buffer holder = pageable(small_ring.max_pinned_bytes + small_ring.staging_chunk_bytes, 0xEE);
  test.device().delay(engine.stream(), stall);
  engine.submit({std::move(holder)});
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (engine.stats().pinned.reserved_bytes.aggregate.current <
         static_cast<std::int64_t>(small_ring.max_pinned_bytes)) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the staging ring never filled";
    std::this_thread::sleep_for(100us);
  }
}

TYPED_TEST(transfer_engine_test, coalesced_batches_each_get_their_own_bytes_read_on_two_streams) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  const backend::stream_ref second = this->other_consumer();
  {
    transfer_engine engine(a, this->copy_stream(), small_ring);
    // Mixed batches: small pageable buffers packed together, a pinned one
    // read directly, one larger than a staging chunk staged chunk by chunk.
    auto pinned_block =
        std::shared_ptr<void>(dev.allocate_pinned_host(4 * kib), [&](void* p) { dev.free_pinned_host(p); });
    std::memset(pinned_block.get(), 0x77, 4 * kib);
    std::vector<std::vector<host_buffer>> mixed;
    for (std::uint64_t i = 0; i < 6; ++i) {
      mixed.push_back({pageable(1000 + i, pattern(i)), host_buffer{pinned_block.get(), 4 * kib, true, pinned_block},
                       pageable(i == 3 ? 3 * mib : 64 * kib, pattern(i + 100))});
    }
    hold_the_engine_thread(*this, engine, 500ms);
    for (auto& batch : mixed) engine.submit(std::move(batch));
    // Still held: the group's copies will run after this stall, so a stream
    // that did not wait would read before them.
    dev.delay(engine.stream(), 100ms);
    (void)engine.next(10s);  // the one that held the thread
    // Every read is enqueued before any is waited for (into pinned memory:
    // asynchronous on CUDA too), so a read that did not wait shows.
    const auto sizes = [](std::uint64_t i) {
      return std::array<std::size_t, 3>{1000 + i, 4 * kib, i == 3 ? 3 * mib : 64 * kib};
    };
    std::vector<transfer::transferred_batch> batches;
    std::vector<std::shared_ptr<std::uint8_t>> seen;
    for (std::uint64_t i = 0; i < 6; ++i) {
      batches.push_back(engine.next(10s));
      auto& batch = batches.back();
      EXPECT_EQ(batch.sequence(), i + 1);
      ASSERT_EQ(batch.storages().size(), 3u);
      // One group: one event, alive while these batches are.
      EXPECT_EQ(batch.ready(), batches.front().ready()) << "batch " << i << " was not in the first one's group";
      // Batches of one group read on two streams in turn.
      const backend::stream_ref on = i % 2 == 0 ? this->consumer() : second;
      batch.wait_on(on);
      for (std::size_t b = 0; b < 3; ++b) {
        const std::size_t n = sizes(i)[b];
        seen.emplace_back(static_cast<std::uint8_t*>(dev.allocate_pinned_host(n)),
                          [&](std::uint8_t* p) { dev.free_pinned_host(p); });
        dev.copy(on, seen.back().get(), batch.storages()[b].data(), n);
      }
    }
    dev.synchronize(this->consumer());
    dev.synchronize(second);
    for (std::uint64_t i = 0; i < 6; ++i) {
      const std::array<std::uint8_t, 3> expected{pattern(i), 0x77, pattern(i + 100)};
      for (std::size_t b = 0; b < 3; ++b) {
        const std::uint8_t* p = seen[i * 3 + b].get();
        EXPECT_TRUE(all_equal(std::vector<std::uint8_t>(p, p + sizes(i)[b]), expected[b]))
            << "batch " << i << " buffer " << b;
      }
    }
    const auto s = engine.stats();
    EXPECT_EQ(s.batches_transferred, 7u);
    EXPECT_EQ(s.coalesced_groups, 2u) << "the one that held the thread, then the six as one group";
    EXPECT_EQ(s.bytes_staged, s.bytes_copied - 6 * 4 * kib) << "the pinned buffers were read directly";
    EXPECT_LE(s.pinned.reserved_bytes.aggregate.peak, static_cast<std::int64_t>(small_ring.max_pinned_bytes));
  }
}

// A group's small pageable buffers are staged together, when their run's
// copy is enqueued: each source must stay alive until then, though the
// engine is done with its batch's other buffers. Each source here overwrites
// its bytes as it is let go, so one let go before it was staged shows as
// wrong bytes (it did when the pack did not hold the sources: checked).
TYPED_TEST(transfer_engine_test, a_packed_pageable_source_is_let_go_only_after_its_bytes_are_staged) {
  auto& a = this->make_allocator();
  std::vector<std::weak_ptr<const void>> sources;
  const auto scribbled_on_release = [&](std::size_t bytes, std::uint8_t value) {
    auto* data = new std::vector<std::uint8_t>(bytes, value);
    std::shared_ptr<const void> owner(data, [](const std::vector<std::uint8_t>* v) {
      std::fill(const_cast<std::vector<std::uint8_t>*>(v)->begin(), const_cast<std::vector<std::uint8_t>*>(v)->end(),
                std::uint8_t{0xDD});
      delete v;
    });
    sources.push_back(owner);
    return host_buffer{data->data(), bytes, false, std::move(owner)};
  };
  {
    transfer_engine engine(a, this->copy_stream(), small_ring);
    hold_the_engine_thread(*this, engine, 200ms);
    for (std::uint64_t i = 0; i < 6; ++i) {
      engine.submit({scribbled_on_release(5000 + i, pattern(i)), scribbled_on_release(64 * kib, pattern(i + 50))});
    }
    (void)engine.next(10s);  // the one that held the thread
    for (std::uint64_t i = 0; i < 6; ++i) {
      transfer::transferred_batch batch = engine.next(10s);
      batch.wait_on(this->consumer());
      EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 5000 + i, this->consumer()), pattern(i)))
          << "batch " << i << ", first buffer";
      EXPECT_TRUE(all_equal(this->read(batch.storages()[1].data(), 64 * kib, this->consumer()), pattern(i + 50)))
          << "batch " << i << ", second buffer";
    }
    EXPECT_EQ(engine.stats().coalesced_groups, 2u) << "the one that held the thread, then the six as one group";
    // Staged and copied: the engine holds none of them any more.
    for (std::size_t k = 0; k < sources.size(); ++k) EXPECT_TRUE(sources[k].expired()) << "source " << k << " held";
  }
}

TYPED_TEST(transfer_engine_test, an_error_in_a_coalesced_batch_fails_only_that_batch_and_leaks_nothing) {
  auto& dev = this->device();
  auto& a = this->make_allocator("memory_limit_mb:12");
  transfer_engine engine(a, this->copy_stream(), small_ring);
  std::atomic<bool> released{false};
  auto pinned_block = std::shared_ptr<void>(dev.allocate_pinned_host(4 * kib), [&](void* p) {
    released = true;
    dev.free_pinned_host(p);
  });
  std::memset(pinned_block.get(), 0x66, 4 * kib);
  // Its small buffer is staged and allocated before the large one fails:
  // past the device allocator's limit, not past max_coalesced_bytes.
  std::vector<host_buffer> failing{pageable(64 * kib, 2),
                                   host_buffer{pinned_block.get(), 4 * kib, true, std::move(pinned_block)},
                                   pageable(32 * mib, 3)};
  hold_the_engine_thread(*this, engine, 500ms);
  engine.submit({pageable(64 * kib, 1)});
  engine.submit(std::move(failing));
  engine.submit({pageable(64 * kib, 4)});
  (void)engine.next(10s);  // the one that held the thread
  const backend::stream_ref s = this->consumer();
  auto first = engine.next(10s);
  EXPECT_THROW((void)engine.next(10s), out_of_memory);
  auto last = engine.next(10s);
  EXPECT_EQ(last.sequence(), 3u);
  // A group takes consecutive batches: the two around the failed one share
  // one event (both alive, so one event, not a reused handle), so all three
  // were one group.
  EXPECT_EQ(first.ready(), last.ready()) << "the failed batch did not share a group with the others";
  first.wait_on(s);
  last.wait_on(s);
  EXPECT_TRUE(all_equal(this->read(first.storages()[0].data(), 64 * kib, s), 1));
  EXPECT_TRUE(all_equal(this->read(last.storages()[0].data(), 64 * kib, s), 4));
  const auto stats = engine.stats();
  EXPECT_EQ(stats.batches_failed, 1u);
  EXPECT_EQ(stats.batches_transferred, 3u);
  EXPECT_EQ(stats.coalesced_groups, 2u) << "the one that held the thread, then the three as one group";
  EXPECT_EQ(stats.in_flight, 0u);
  EXPECT_EQ(a.stats().allocations.aggregate.current, 2) << "only the two batches held here";
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!released && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(released) << "the failed batch's pinned source is let go once the group's copies have run";
  EXPECT_EQ(engine.stats().pinned.allocations.aggregate.current, 0) << "every staging block was given back";
}

// A group's storages are parts of one device block (one allocation for the
// group), and its small pageable buffers, packed in the same layout, go to
// the device as one copy; each batch still reads its own bytes, on either of
// two streams, and the block is freed with the group's last storage.
TYPED_TEST(transfer_engine_test, a_groups_storages_share_one_device_block_and_its_packed_buffers_one_copy) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  const auto sizes = [](std::uint64_t i) { return std::array<std::size_t, 2>{1000 + i, 64 * kib}; };
  transfer_engine engine(a, this->copy_stream(), small_ring);
  std::vector<std::vector<host_buffer>> small;  // with the holder, max_batches_in_flight in flight
  for (std::uint64_t i = 0; i < 7; ++i) {
    small.push_back({pageable(sizes(i)[0], pattern(i)), pageable(sizes(i)[1], pattern(i + 100))});
  }
  hold_the_engine_thread(*this, engine, 500ms);
  for (auto& batch : small) engine.submit(std::move(batch));
  dev.delay(engine.stream(), 100ms);  // the group's copies run late: a read that did not wait shows
  (void)engine.next(10s);             // the one that held the thread, dropped
  std::vector<transfer::transferred_batch> batches;
  std::vector<std::shared_ptr<std::uint8_t>> seen;
  for (std::uint64_t i = 0; i < 7; ++i) {
    batches.push_back(engine.next(10s));
    const backend::stream_ref on = i % 2 == 0 ? this->consumer() : this->other_consumer();
    batches.back().wait_on(on);
    for (std::size_t b = 0; b < 2; ++b) {
      seen.emplace_back(static_cast<std::uint8_t*>(dev.allocate_pinned_host(sizes(i)[b])),
                        [&](std::uint8_t* p) { dev.free_pinned_host(p); });
      dev.copy(on, seen.back().get(), batches.back().storages()[b].data(), sizes(i)[b]);
    }
  }
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1) << "one device block for the group's 14 storages";
  const auto s = engine.stats();
  EXPECT_EQ(s.coalesced_groups, 2u) << "the one that held the thread, then the seven as one group";
  const std::size_t holder_chunks = (small_ring.max_pinned_bytes + small_ring.staging_chunk_bytes) / mib;
  EXPECT_EQ(s.copies, holder_chunks + 1) << "the holder chunk by chunk, then the group's packed run as one copy";
  dev.synchronize(this->consumer());
  dev.synchronize(this->other_consumer());
  for (std::uint64_t i = 0; i < 7; ++i) {
    const std::array<std::uint8_t, 2> expected{pattern(i), pattern(i + 100)};
    for (std::size_t b = 0; b < 2; ++b) {
      const std::uint8_t* p = seen[i * 2 + b].get();
      EXPECT_TRUE(all_equal(std::vector<std::uint8_t>(p, p + sizes(i)[b]), expected[b])) << "batch " << i << " buffer " << b;
    }
  }
  batches.erase(batches.begin(), batches.end() - 1);
  EXPECT_EQ(a.stats().allocations.aggregate.current, 1) << "the block lives while one of its storages does";
  batches.clear();
  EXPECT_EQ(a.stats().allocations.aggregate.current, 0);
}

TYPED_TEST(transfer_engine_test, bad_batches_and_settings_are_refused_before_anything_is_queued) {
  auto& a = this->make_allocator();
  EXPECT_THROW(transfer_engine(a, this->copy_stream(), {.max_batches_in_flight = 0}), invalid_argument);
  EXPECT_THROW(transfer_engine(a, this->copy_stream(), {.max_pinned_bytes = mib, .staging_chunk_bytes = 2 * mib}),
               invalid_argument);
  // Below the pinned allocator's smallest segment, though a chunk fits: no array could be staged.
  EXPECT_THROW(transfer_engine(a, this->copy_stream(), {.max_pinned_bytes = mib, .staging_chunk_bytes = 256 * kib}),
               invalid_argument);
  // A chunk takes what the pinned allocator reserves for it, rounded up to 2
  // MiB: a 3 MiB chunk takes 4, so a 3 MiB bound could stage no large buffer.
  try {
    transfer_engine engine(a, this->copy_stream(), {.max_pinned_bytes = 3 * mib, .staging_chunk_bytes = 3 * mib});
    ADD_FAILURE() << "a staging bound that holds no chunk was accepted";
  } catch (const invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("max_pinned_bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("staging_chunk_bytes"), std::string::npos) << what;
  }
  transfer_engine engine(a, this->copy_stream());
  EXPECT_THROW(engine.submit({}), invalid_argument);
  EXPECT_THROW(engine.submit({host_buffer{nullptr, 16}}), invalid_argument);
  std::uint8_t byte = 0;
  EXPECT_THROW(engine.submit({host_buffer{&byte, 0}}), invalid_argument);
  // Bytes that no address space holds, or that wrap around when summed,
  // would count as next to nothing against max_bytes_in_flight.
  constexpr std::size_t half = std::numeric_limits<std::size_t>::max() / 2 + 1;
  EXPECT_THROW(engine.submit({host_buffer{&byte, half}, host_buffer{&byte, half}}), invalid_argument);
  EXPECT_THROW(engine.submit({host_buffer{&byte, half}}), invalid_argument);
  EXPECT_EQ(engine.stats().batches_submitted, 0u);
  EXPECT_FALSE(engine.try_next().has_value());
  EXPECT_THROW((void)engine.next(20ms), timeout_error);
}

// A chunk that is no multiple of 2 MiB stages within a bound of its size
// rounded up to 2 MiB, what the pinned allocator reserves for it.
TYPED_TEST(transfer_engine_test, a_3_mib_chunk_stages_within_a_4_mib_bound) {
  auto& a = this->make_allocator();
  transfer_engine engine(a, this->copy_stream(), {.max_pinned_bytes = 4 * mib, .staging_chunk_bytes = 3 * mib});
  engine.submit({pageable(7 * mib + 5, 0x21), pageable(100 * kib, 0x22)});
  auto batch = engine.next(10s);
  batch.wait_on(this->consumer());
  EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 7 * mib + 5, this->consumer()), 0x21));
  EXPECT_TRUE(all_equal(this->read(batch.storages()[1].data(), 100 * kib, this->consumer()), 0x22));
  EXPECT_LE(engine.stats().pinned.reserved_bytes.aggregate.peak, static_cast<std::int64_t>(4 * mib));
}

// Two batches of the most bytes a batch may have are in flight (each fails:
// no device has that much memory); a third of a few bytes must wait for
// room, though the sum of all three passes what a size_t counts.
TYPED_TEST(transfer_engine_test, the_byte_bound_holds_when_the_bytes_in_flight_near_what_a_size_t_counts) {
  auto& a = this->make_allocator();
  transfer_engine engine(a, this->copy_stream());
  std::uint8_t byte = 0;
  constexpr auto most = static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max());
  engine.submit({host_buffer{&byte, most}});
  engine.submit({host_buffer{&byte, most}});
  EXPECT_THROW(engine.submit({host_buffer{&byte, 4}}, 20ms), timeout_error);
  for (int i = 0; i < 2; ++i) EXPECT_THROW((void)engine.next(10s), out_of_memory);
  engine.submit({host_buffer{&byte, 4}}, 10s);
  engine.next(10s).synchronize();
}

// A timeout of centuries is as good as none: it is not turned into a
// clock's count that overflows into a deadline already past.
TYPED_TEST(transfer_engine_test, waits_with_timeouts_of_centuries_wait_for_the_batch) {
  auto& a = this->make_allocator();
  transfer_engine engine(a, this->copy_stream(), {.max_batches_in_flight = 1});
  constexpr std::chrono::hours centuries(24 * 365 * 300);
  std::thread producer([&] {
    std::this_thread::sleep_for(100ms);
    engine.submit({pageable(kib, 1)});
  });
  try {
    EXPECT_EQ(engine.next(centuries).sequence(), 0u);
  } catch (const timeout_error& e) {
    ADD_FAILURE() << "next did not wait for the batch submitted later: " << e.what();
    (void)engine.next(10s);
  }
  producer.join();
  engine.submit({pageable(kib, 2)});  // the one batch that may be in flight
  std::thread consumer([&] {
    std::this_thread::sleep_for(100ms);
    (void)engine.next(10s);
  });
  try {
    EXPECT_EQ(engine.submit({pageable(kib, 3)}, centuries), 2u);
    (void)engine.next(10s);
  } catch (const timeout_error& e) {
    ADD_FAILURE() << "submit did not wait for the room made later: " << e.what();
  }
  consumer.join();
}

TYPED_TEST(transfer_engine_test, batches_never_taken_are_freed_when_the_engine_stops) {
  auto& a = this->make_allocator();
  {
    transfer_engine engine(a, this->copy_stream());
    for (int i = 0; i < 3; ++i) engine.submit({pageable(mib, 7)});
    auto first = engine.next(10s);  // taken and dropped; the other two never are
  }
  // TearDown checks that no device storage is left allocated.
}

}  // namespace
}  // namespace shoal::testing
