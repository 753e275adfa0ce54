// The background transfer engine on both backends: bytes and order, the
// seed race through the engine (and its unsafe control), sources held only
// as long as needed, backpressure bounds, failed batches, and nothing left
// allocated at the end.
#include "shoal/transfer/transfer_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "shoal/core/error.h"
#include "support/backends.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using transfer::host_buffer;
using transfer::transfer_config;
using transfer::transfer_engine;
constexpr std::size_t kib = 1024, mib = kib * kib;

// A pageable host buffer of `bytes` bytes, each `value`, that the engine holds.
host_buffer pageable(std::size_t bytes, std::uint8_t value) {
  auto data = std::make_shared<std::vector<std::uint8_t>>(bytes, value);
  return host_buffer{data->data(), bytes, false, data};
}

std::uint8_t pattern(std::uint64_t i) { return static_cast<std::uint8_t>(0x10 + i % 200); }

template <class Backend>
class transfer_engine_test : public backend_test<Backend> {
 public:
  alloc::caching_allocator& make_allocator(std::string_view conf = "") {
    copy_stream_ = std::make_unique<stream>(this->device());
    allocator_ = std::make_unique<alloc::caching_allocator>(this->device(), alloc::allocator_config::parse(conf));
    return *allocator_;
  }
  /// The engine's copy stream: made before the allocator, gone after it.
  backend::stream_ref copy_stream() const { return copy_stream_->ref(); }

 protected:
  void TearDown() override {
    if (allocator_ == nullptr) return;
    EXPECT_EQ(allocator_->stats().allocations.aggregate.current, 0) << "device storages left allocated";
    allocator_.reset();
  }
  std::unique_ptr<stream> copy_stream_;
  std::unique_ptr<alloc::caching_allocator> allocator_;
};
TYPED_TEST_SUITE(transfer_engine_test, backend_types, backend_names);

TYPED_TEST(transfer_engine_test, batches_arrive_in_submission_order_with_every_byte) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  transfer_engine engine(a, this->copy_stream(),
                         {.max_batches_in_flight = 3, .max_pinned_bytes = 2 * mib, .staging_chunk_bytes = 256 * kib});
  stream consumer(dev);
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
template <class Test>
int corrupted_batches(Test& test, bool record_use) {
  auto& dev = test.device();
  auto& a = test.make_allocator();
  transfer_engine engine(a, test.copy_stream(), {.max_batches_in_flight = 4});
  constexpr std::uint64_t batches = 16;
  constexpr std::size_t bytes = 256 * kib;
  stream model(dev);
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < batches; ++i) engine.submit({pageable(bytes, pattern(i))});
  });
  // Pinned, so that the reads are asynchronous on CUDA too (a copy into
  // pageable memory returns only once it has run, which would serialize the
  // consumer with its stream and hide the race).
  auto* seen = static_cast<std::uint8_t*>(dev.allocate_pinned_host(batches * bytes));
  for (std::uint64_t i = 0; i < batches; ++i) {
    auto batch = engine.next(10s);
    if (record_use) {
      batch.wait_on(model);
    } else {
      dev.wait(model, batch.ready());
    }
    dev.delay(model, 20ms);  // the model is busy before it reads the batch
    dev.copy(model, seen + i * bytes, batch.storages()[0].data(), bytes);
  }  // each batch dropped right after its read was enqueued
  producer.join();
  dev.synchronize(model);
  int corrupted = 0;
  for (std::uint64_t i = 0; i < batches; ++i) {
    corrupted += all_equal(std::vector<std::uint8_t>(seen + i * bytes, seen + (i + 1) * bytes), pattern(i)) ? 0 : 1;
  }
  dev.free_pinned_host(seen);
  return corrupted;
}

TYPED_TEST(transfer_engine_test, a_batch_dropped_while_its_read_is_queued_is_never_overwritten) {
  EXPECT_EQ(corrupted_batches(*this, true), 0);
}

TYPED_TEST(transfer_engine_test, control_without_the_use_recorded_the_engine_overwrites_batches_still_being_read) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a real data race between two streams, on purpose: not under ThreadSanitizer";
#endif
  EXPECT_GT(corrupted_batches(*this, false), 0) << "the race did not show: the safe test would prove nothing";
}

TYPED_TEST(transfer_engine_test, a_pinned_source_is_held_until_the_copy_reading_it_has_run) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  alloc::caching_allocator pinned_memory(dev, alloc::allocator_config::parse("memory:pinned_host"));
  transfer_engine engine(a, this->copy_stream());
  stream s(dev);
  void* block = pinned_memory.allocate(64 * kib, s);
  std::memset(block, 0x5A, 64 * kib);
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
  pinned_memory.deallocate(block, s);
}

TYPED_TEST(transfer_engine_test, a_fast_producer_stays_within_the_batch_and_pinned_bounds) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  const transfer_config config{.max_batches_in_flight = 2, .max_pinned_bytes = 4 * mib, .staging_chunk_bytes = mib};
  transfer_engine engine(a, this->copy_stream(), config);
  dev.delay(engine.stream(), 100ms);
  engine.submit({pageable(3 * mib, 1)});
  engine.submit({pageable(3 * mib, 2)});
  EXPECT_THROW(engine.submit({pageable(3 * mib, 3)}, 50ms), timeout_error) << "a third batch while two are in flight";
  stream consumer(dev);
  std::atomic<bool> done{false};
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < 20; ++i) engine.submit({pageable(3 * mib, pattern(i))});
    done = true;
  });
  for (int i = 0; i < 22; ++i) {
    auto batch = engine.next(10s);
    batch.wait_on(consumer);
    dev.delay(consumer, 5ms);  // a slow consumer
  }
  producer.join();
  dev.synchronize(consumer);
  const auto s = engine.stats();
  EXPECT_LE(s.peak_in_flight, config.max_batches_in_flight);
  EXPECT_LE(s.pinned.reserved_bytes.aggregate.peak, static_cast<std::int64_t>(config.max_pinned_bytes));
  EXPECT_EQ(s.bytes_staged, 22u * 3 * mib);
}

// The default ring (max_pinned_bytes) is smaller than a large buffer: the
// buffer goes through it chunk by chunk, each block rewritten only after the
// copy that read it, whichever stores write it.
TYPED_TEST(transfer_engine_test, a_buffer_larger_than_the_staging_ring_arrives_whole_with_each_kind_of_store) {
  auto& dev = this->device();
  auto& a = this->make_allocator();
  const std::size_t bytes = transfer_config{}.max_pinned_bytes + 5 * mib + 17;
  for (auto stores : {transfer_config::stores::streaming, transfer_config::stores::cached}) {
    transfer_engine engine(a, this->copy_stream(), {.staging_stores = stores});
    stream consumer(dev);
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
  stream s(dev);  // before the batch: a stream must outlive the storages used on it
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

TYPED_TEST(transfer_engine_test, bad_batches_and_settings_are_refused_before_anything_is_queued) {
  auto& a = this->make_allocator();
  EXPECT_THROW(transfer_engine(a, this->copy_stream(), {.max_batches_in_flight = 0}), invalid_argument);
  EXPECT_THROW(transfer_engine(a, this->copy_stream(), {.max_pinned_bytes = mib, .staging_chunk_bytes = 2 * mib}), invalid_argument);
  transfer_engine engine(a, this->copy_stream());
  EXPECT_THROW(engine.submit({}), invalid_argument);
  EXPECT_THROW(engine.submit({host_buffer{nullptr, 16}}), invalid_argument);
  std::uint8_t byte = 0;
  EXPECT_THROW(engine.submit({host_buffer{&byte, 0}}), invalid_argument);
  EXPECT_EQ(engine.stats().batches_submitted, 0u);
  EXPECT_FALSE(engine.try_next().has_value());
  EXPECT_THROW((void)engine.next(20ms), timeout_error);
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
