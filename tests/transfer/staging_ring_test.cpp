// The staging ring at its smallest (transfer_engine.h: "a buffer of any size
// can be staged"): a ring of one chunk stages a buffer larger than a chunk
// after a small one; and a failed batch that read a caller's pinned memory
// directly, with no keep_alive, is reported only once that copy has run
// (host_buffer::keep_alive). On both backends; a staging block whose free
// the host refused: transfer_engine_host_failures_test.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/transfer/transfer_engine.h"
#include "support/backends.h"
#include "support/forwarding_device.h"
#include "support/host_buffers.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::stream;
using transfer::host_buffer;
using transfer::transfer_engine;
constexpr std::size_t kib = 1024, mib = kib * kib;

template <class Backend>
using staging_ring = backend_test<Backend>;
TYPED_TEST_SUITE(staging_ring, backend_types, backend_names);

// A packed batch's staging block is freed into the pinned allocator's small
// pool, where it waits for a shared event (awaiting); the next batch's
// chunk, from the large pool, finds the ring's one chunk of memory taken by
// that small pool's segment. Its wait at the limit must seal and wait for
// the small pool's free too, and give that segment back.
TYPED_TEST(staging_ring, a_chunked_batch_after_a_small_one_stages_through_a_one_chunk_ring) {
  stream copy_stream(this->device()), consumer(this->device());
  alloc::caching_allocator a(this->device(), {});
  transfer_engine engine(a, copy_stream.ref(),
                         {.max_pinned_bytes = 4 * mib, .staging_chunk_bytes = 4 * mib, .max_coalesced_bytes = 0});
  engine.submit({pageable(300 * kib, 1)});
  engine.next(10s).synchronize();
  engine.submit({pageable(4 * mib + 1, 2)});
  auto batch = engine.next(10s);  // threw out_of_memory, with nothing allocated, before the fix
  batch.wait_on(consumer.ref());
  EXPECT_TRUE(all_equal(this->read(batch.storages()[0].data(), 4 * mib + 1, consumer.ref()), 2));
  EXPECT_LE(engine.stats().pinned.reserved_bytes.aggregate.peak, std::int64_t{4 * mib}) << "the ring's bound";
}

// Random mixes of packed and chunked buffers, batches queued together,
// through rings of one to three chunks: every batch arrives.
TYPED_TEST(staging_ring, random_mixes_of_small_and_chunked_buffers_stage_through_small_rings) {
  for (const std::size_t chunk : {2 * mib, 4 * mib}) {
    for (const std::size_t ring_chunks : {1, 2, 3}) {
      stream copy_stream(this->device());
      alloc::caching_allocator a(this->device(), {});
      std::uint32_t seed = 12345;
      const auto next_random = [&] {
        seed = seed * 1664525u + 1013904223u;
        return seed >> 8;
      };
      transfer_engine engine(a, copy_stream.ref(),
                             {.max_batches_in_flight = 8, .max_pinned_bytes = ring_chunks * chunk,
                              .staging_chunk_bytes = chunk, .max_coalesced_bytes = 16 * mib});
      constexpr int batches = 30;
      std::thread producer([&] {
        for (int b = 0; b < batches; ++b) {
          std::vector<host_buffer> batch;
          const std::size_t sizes[] = {100, 300 * kib, mib + 7, 3 * mib + 1, chunk, chunk + 1, 2 * chunk + 5};
          for (std::uint32_t i = 0, n = 1 + next_random() % 4; i < n; ++i) {
            batch.push_back(pageable(sizes[next_random() % 7], static_cast<std::uint8_t>(b)));
          }
          engine.submit(std::move(batch));
        }
      });
      int failed = 0;
      for (int b = 0; b < batches; ++b) {
        auto taken = engine.take(30s);
        if (taken.error) {
          ++failed;
        } else {
          taken.batch->synchronize();
        }
      }
      producer.join();
      EXPECT_EQ(failed, 0) << "chunks of " << chunk << " bytes, a ring of " << ring_chunks;
    }
  }
}

// Fails every copy of exactly `fail_bytes` bytes, and every event record
// while `fail_records` is set.
class failing_size_device : public forwarding_device {
 public:
  failing_size_device(backend::device& target, std::size_t fail_bytes)
      : forwarding_device(target), fail_bytes_(fail_bytes) {}
  void copy(backend::stream_ref s, void* dst, const void* src, std::size_t bytes) override {
    if (bytes == fail_bytes_) throw backend_error("copy", "refused by the test");
    forwarding_device::copy(s, dst, src, bytes);
  }
  void record(backend::event_ref event, backend::stream_ref s) override {
    if (fail_records) throw backend_error("event record", "refused by the test");
    forwarding_device::record(event, s);
  }
  std::atomic<bool> fail_records{false};

 private:
  const std::size_t fail_bytes_;
};

// What fails the batch: another buffer's copy, or the group's ready event.
enum class failing_step { copy, ready_event };

// Submits a batch of a pinned buffer (kept alive by the engine or not) and,
// for failing_step::copy, a buffer whose copy fails, behind 300 ms of work on
// the engine's stream; true when the engine's stream was still busy as
// next() reported the failure (the pinned buffer's copy still queued).
template <class Test>
bool queued_when_the_failure_is_reported(Test& test, bool kept_alive, failing_step step = failing_step::copy) {
  constexpr std::size_t failing = 12345;
  failing_size_device dev(test.device(), failing);
  stream copy_stream(dev);
  alloc::caching_allocator a(dev, {});
  void* pinned = dev.allocate_pinned_host(64 * kib);
  std::shared_ptr<const void> owner;
  if (kept_alive) owner.reset(pinned, [&dev](const void* p) { dev.free_pinned_host(const_cast<void*>(p)); });
  bool queued = false;
  {
    transfer_engine engine(a, copy_stream.ref());
    dev.delay(engine.stream(), 300ms);  // the pinned buffer's copy runs late
    std::vector<host_buffer> batch{host_buffer{pinned, 64 * kib, true, std::move(owner)}};
    if (step == failing_step::copy) batch.push_back(pageable(failing, 1));
    dev.fail_records = step == failing_step::ready_event;
    engine.submit(std::move(batch));
    EXPECT_THROW((void)engine.next(10s), backend_error);
    dev.fail_records = false;
    queued = !dev.query(engine.stream());
  }
  if (!kept_alive) dev.free_pinned_host(pinned);
  return queued;
}

// A pinned buffer given without keep_alive is the caller's to keep valid
// "until the batch is ready"; a failed batch is never ready, so its failure
// is reported only once the copy reading the buffer has run: the caller may
// free the buffer at the error.
TYPED_TEST(staging_ring, a_failed_batch_is_reported_once_its_copy_from_the_callers_pinned_memory_has_run) {
  EXPECT_FALSE(queued_when_the_failure_is_reported(*this, false))
      << "the failure came while the copy reading the caller's buffer was queued";
}

// The same where the group's ready event cannot be recorded (every batch of
// the group fails, its transferred ones too).
TYPED_TEST(staging_ring, a_batch_failed_by_its_ready_event_is_reported_once_its_copy_from_the_callers_memory_has_run) {
  EXPECT_FALSE(queued_when_the_failure_is_reported(*this, false, failing_step::ready_event))
      << "the failure came while the copy reading the caller's buffer was queued";
}

// The control: a buffer with keep_alive is held by the engine until its copy
// has run, so the failure is reported at once, the copy still queued (the
// wait above is the engine's, not a side effect of reporting a failure).
TYPED_TEST(staging_ring, a_failed_batch_whose_pinned_buffer_is_kept_alive_is_reported_at_once) {
  EXPECT_TRUE(queued_when_the_failure_is_reported(*this, true)) << "the engine waited for a copy whose source it holds";
}

}  // namespace
}  // namespace shoal::testing
