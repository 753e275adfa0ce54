// Ordering contract of streams and events, on every backend.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "support/backends.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
using backend::event;
using backend::stream;

template <class Backend>
class stream_event : public backend_test<Backend> {
 protected:
  void SetUp() override {
    backend_test<Backend>::SetUp();
    if (this->IsSkipped()) return;
    buffer_ = this->device().allocate_segment(bytes);
  }
  void TearDown() override {
    if (buffer_ != nullptr) this->device().free_segment(buffer_);
  }
  static constexpr std::size_t bytes = 1 << 20;
  void* buffer_ = nullptr;
};
TYPED_TEST_SUITE(stream_event, backend_types, backend_names);

// What a forced clear of a private pool rests on: every stream of the
// device is waited for, one destroyed with work still queued included.
TYPED_TEST(stream_event, synchronizing_the_device_waits_for_every_stream_destroyed_ones_included) {
  auto& dev = this->device();
  std::atomic<bool> on_a_stream{false}, on_a_destroyed_stream{false};
  stream kept(dev);
  event e(dev);
  dev.delay(kept, 200ms);
  dev.host_task(kept, [&] { on_a_stream = true; });
  {
    stream gone(dev);
    dev.delay(gone, 300ms);
    dev.host_task(gone, [&] { on_a_destroyed_stream = true; });
    e.record(gone);  // its work goes on after the stream is destroyed
  }
  dev.synchronize_device();
  EXPECT_TRUE(on_a_stream.load());
  EXPECT_TRUE(on_a_destroyed_stream.load()) << "returned while a destroyed stream still had work queued";
}

TYPED_TEST(stream_event, adopting_the_default_or_an_own_stream_gives_it_back_as_it_is) {
  auto& dev = this->device();
  stream s(dev);
  EXPECT_TRUE(dev.adopt_external_stream(nullptr).is_default());
  EXPECT_EQ(dev.adopt_external_stream(s.ref().native), s.ref());
  EXPECT_EQ(dev.adopt_external_stream(s.ref().native), s.ref()) << "idempotent";
  dev.fill(s, this->buffer_, 1, this->bytes);
  dev.synchronize(s);
}

TEST(stream_event_host, a_pointer_that_is_no_stream_is_not_adopted) {
  backend::host_device dev;
  int not_a_stream = 0;
  EXPECT_THROW((void)dev.adopt_external_stream(&not_a_stream), invalid_argument);
  EXPECT_THROW(dev.synchronize(backend::stream_ref{&not_a_stream}), invalid_argument) << "nor usable after";
}

std::size_t threads_of_this_process() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// An allocator pools the events it recorded on streams: a host stream's
// thread must not live on with them, or a stream per request leaves a thread
// per request behind.
TEST(stream_event_host, a_destroyed_streams_thread_ends_while_an_event_recorded_there_lives) {
  backend::host_device dev;
  event e(dev);
  const std::size_t before = threads_of_this_process();
  std::atomic<bool> ran{false};
  {
    stream s(dev);
    dev.delay(s, 50ms);
    dev.host_task(s, [&] { ran = true; });
    e.record(s);
    EXPECT_EQ(threads_of_this_process(), before + 1);
  }
  e.synchronize();
  EXPECT_TRUE(ran.load()) << "the work queued before the destroy ran";
  EXPECT_TRUE(e.query());
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (threads_of_this_process() > before && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(threads_of_this_process(), before) << "the destroyed stream's thread lives on with the event";
  stream other(dev);
  dev.wait(other, e);  // the event still orders other streams
  dev.synchronize(other);
  dev.synchronize_device();
}

// Runs `destroy` on another thread; true when it returned within 2 s. A
// destroy that waits for its stream's work would wait for ever here (the
// work waits for what comes after the destroy): `unblock` then lets it end.
template <class Destroy, class Unblock>
bool returns_at_once(Destroy destroy, Unblock unblock) {
  std::atomic<bool> done{false};
  std::thread destroying([&] {
    destroy();
    done = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (!done && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  const bool at_once = done;
  unblock();
  destroying.join();
  return at_once;
}

// As on CUDA, a destroy returns while the stream's work goes on; its work
// still runs, and synchronize_device waits for it. (A receiver dropping a
// stream whose wait for another process's stream has not passed must not
// block on that process.)
TEST(stream_event_host, a_destroy_returns_while_the_streams_work_waits_and_the_work_still_runs) {
  backend::host_device dev;
  std::atomic<bool> go{false}, ran{false};
  const backend::stream_ref s = dev.create_stream();
  dev.host_task(s, [&] {
    while (!go) std::this_thread::sleep_for(1ms);
    ran = true;
  });
  EXPECT_TRUE(returns_at_once([&] { dev.destroy_stream(s); }, [&] { go = true; }))
      << "the destroy waited for the stream's work";
  dev.synchronize_device();
  EXPECT_TRUE(ran.load()) << "synchronize_device returned before a destroyed stream's work ran";
}

// Each of two streams waits for an event of the other: the one destroyed
// first may have its last owner in the other's wait, which must not join a
// thread that waits for that very wait to pass.
TEST(stream_event_host, streams_waiting_on_each_other_are_destroyed_without_a_deadlock) {
  backend::host_device dev;
  std::atomic<bool> go{false};
  const backend::stream_ref a = dev.create_stream(), b = dev.create_stream();
  {
    event on_b(dev), on_a(dev);
    dev.host_task(b, [&] {
      while (!go) std::this_thread::sleep_for(1ms);
    });
    on_b.record(b);
    dev.wait(a, on_b);
    on_a.record(a);
    dev.wait(b, on_a);
  }  // the events go: a's wait holds b's executor
  EXPECT_TRUE(returns_at_once([&] { dev.destroy_stream(b); }, [&] { go = true; }));
  dev.synchronize(a);
  dev.destroy_stream(a);
  dev.synchronize_device();
}

// A task holding the last owner of its own stream destroys it from the
// stream's thread: that thread must not join itself.
TEST(stream_event_host, a_task_that_holds_its_own_stream_may_destroy_it) {
  backend::host_device dev;
  std::atomic<bool> ran{false}, released{false};
  {
    auto own = std::make_shared<stream>(dev);
    dev.host_task(*own, [&ran, &released, own] {
      while (!released) std::this_thread::sleep_for(1ms);
      ran = true;
    });
  }
  released = true;  // the task's copy is the last owner now
  while (!ran) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);  // holding no executor meanwhile (synchronize_device would)
  dev.synchronize_device();
}

// A destroyed stream's work may still write the device's memory: the
// device's end waits for it (its thread, detached, would run on otherwise).
TEST(stream_event_host, the_devices_end_waits_for_the_work_its_destroyed_streams_still_run) {
  std::atomic<bool> ran{false};
  {
    backend::host_device dev;
    const backend::stream_ref s = dev.create_stream();
    dev.host_task(s, [&ran] {
      std::this_thread::sleep_for(200ms);
      ran = true;
    });
    dev.destroy_stream(s);
  }
  EXPECT_TRUE(ran) << "the device ended before its destroyed stream's work ran";
}

// The host backend's test mode: a random pause before each work item,
// stream order kept; SHOAL_HOST_STREAM_LAG sets it where no option does.
TEST(stream_event_host, a_stream_lag_delays_each_work_item_and_keeps_the_order) {
  using clock = std::chrono::steady_clock;
  constexpr int items = 20;
  for (const bool lagging : {false, true}) {
    backend::host_device dev(
        {.stream_lag = backend::host_stream_lag{.max = lagging ? 20ms : 0ms, .seed = 7}});
    stream s(dev);
    std::vector<int> order;
    const auto start = clock::now();
    for (int i = 0; i < items; ++i) dev.host_task(s, [&order, i] { order.push_back(i); });
    dev.synchronize(s);
    const auto took = clock::now() - start;
    ASSERT_EQ(order.size(), static_cast<std::size_t>(items));
    for (int i = 0; i < items; ++i) EXPECT_EQ(order[i], i);
    // 20 pauses of 0-20 ms: 200 ms expected, under 60 ms about once in 10^8.
    if (lagging) EXPECT_GT(took, 60ms) << "no pause before the work items";
  }
}

// Sets an environment variable for its life, then puts back what was there.
class scoped_environment {
 public:
  scoped_environment(const char* name, const char* value) : name_(name) {
    if (const char* was = std::getenv(name)) was_ = was;
    ::setenv(name, value, 1);
  }
  scoped_environment(const scoped_environment&) = delete;
  scoped_environment& operator=(const scoped_environment&) = delete;
  ~scoped_environment() {
    if (was_) {
      ::setenv(name_, was_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> was_;
};

TEST(stream_event_host, a_stream_lag_must_parse_and_stay_under_a_second) {
  for (const char* bad : {"abc", "-5", "10:", "10:x", "10 ", "0x10", "1000001", "9223372036854775807",
                          "10:99999999999999999999"}) {
    const scoped_environment lag("SHOAL_HOST_STREAM_LAG", bad);
    EXPECT_THROW(backend::host_device dev, invalid_argument) << bad;
  }
  for (const char* good : {"", "0:3", "1000000"}) {
    const scoped_environment lag("SHOAL_HOST_STREAM_LAG", good);
    EXPECT_NO_THROW(backend::host_device dev) << good;
  }
  EXPECT_THROW(backend::host_device({.stream_lag = backend::host_stream_lag{.max = 2s}}), invalid_argument);
}

TYPED_TEST(stream_event, work_runs_after_the_call_returns_and_in_order) {
  auto& dev = this->device();
  stream s(dev);
  dev.delay(s, 100ms);
  dev.fill(s, this->buffer_, 0xAA, this->bytes);
  EXPECT_FALSE(dev.query(s)) << "the delay must still be running when the call returns";
  const auto first = this->read(this->buffer_, this->bytes, s);
  dev.fill(s, this->buffer_, 0xBB, this->bytes);
  const auto second = this->read(this->buffer_, this->bytes, s);
  EXPECT_TRUE(all_equal(first, 0xAA));
  EXPECT_TRUE(all_equal(second, 0xBB));
  EXPECT_TRUE(dev.query(s));
}

TYPED_TEST(stream_event, a_stream_waiting_on_an_event_sees_the_other_streams_writes) {
  auto& dev = this->device();
  stream producer(dev);
  stream consumer(dev);
  event written(dev);
  dev.fill(producer, this->buffer_, 0x00, this->bytes);
  dev.synchronize(producer);
  dev.delay(producer, 100ms);
  dev.fill(producer, this->buffer_, 0x5A, this->bytes);
  written.record(producer);
  dev.wait(consumer, written);
  EXPECT_TRUE(all_equal(this->read(this->buffer_, this->bytes, consumer), 0x5A));
}

TYPED_TEST(stream_event, without_a_wait_another_stream_runs_ahead) {
  // The hazard the allocator must guard against is real on this backend.
  auto& dev = this->device();
  stream producer(dev);
  stream consumer(dev);
  dev.fill(producer, this->buffer_, 0x00, this->bytes);
  dev.synchronize(producer);
  dev.delay(producer, 1000ms);
  dev.fill(producer, this->buffer_, 0x5A, this->bytes);
  const auto seen = this->read(this->buffer_, this->bytes, consumer);
  ASSERT_FALSE(dev.query(producer)) << "the consumer finished while the producer was still delayed";
  EXPECT_TRUE(all_equal(seen, 0x00)) << "the consumer read the producer's later write";
  dev.synchronize(producer);
}

TYPED_TEST(stream_event, event_query_and_synchronize) {
  auto& dev = this->device();
  stream s(dev);
  event e(dev);
  EXPECT_TRUE(e.query()) << "an event never recorded is complete";
  dev.delay(s, 100ms);
  e.record(s);
  EXPECT_FALSE(e.query());
  e.synchronize();
  EXPECT_TRUE(e.query());
}

TYPED_TEST(stream_event, recording_again_moves_the_event) {
  auto& dev = this->device();
  stream s(dev);
  event e(dev);
  e.record(s);
  e.synchronize();
  dev.delay(s, 100ms);
  EXPECT_TRUE(e.query()) << "work enqueued after the record is not part of it";
  e.record(s);
  EXPECT_FALSE(e.query());
  dev.synchronize(s);
  EXPECT_TRUE(e.query());
}

TYPED_TEST(stream_event, waiting_on_an_event_does_not_block_the_caller) {
  auto& dev = this->device();
  stream a(dev);
  stream b(dev);
  event e(dev);
  dev.delay(a, 2s);  // long beside the bound below: a loaded machine stays within both
  e.record(a);
  const auto start = std::chrono::steady_clock::now();
  dev.wait(b, e);
  dev.fill(b, this->buffer_, 1, this->bytes);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_FALSE(dev.query(b)) << "b must be held behind a's delay";
  dev.synchronize(b);
  EXPECT_TRUE(e.query());
}

TYPED_TEST(stream_event, host_tasks_run_in_stream_order_and_report_failures) {
  auto& dev = this->device();
  stream s(dev);
  std::atomic<int> step{0};
  int order_seen = -1;
  dev.delay(s, 50ms);
  dev.host_task(s, [&] { order_seen = step.fetch_add(1); });
  EXPECT_EQ(step.load(), 0);
  dev.host_task(s, [] { throw std::runtime_error("kernel stand-in failed"); });
  try {
    dev.synchronize(s);
    FAIL() << "synchronize must report the failed task";
  } catch (const stream_error& e) {
    EXPECT_NE(std::string(e.what()).find("kernel stand-in failed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(order_seen, 0);
  dev.host_task(s, [&] { step.fetch_add(1); });
  EXPECT_NO_THROW(dev.synchronize(s)) << "a reported failure is not reported twice";
  EXPECT_EQ(step.load(), 2);
}

TYPED_TEST(stream_event, work_pending_on_a_destroyed_stream_still_completes) {
  auto& dev = this->device();
  event done(dev);
  const backend::stream_ref s = dev.create_stream();
  dev.fill(s, this->buffer_, 0x00, this->bytes);
  dev.delay(s, 100ms);
  dev.fill(s, this->buffer_, 0x7C, this->bytes);
  done.record(s);
  dev.destroy_stream(s);
  done.synchronize();
  EXPECT_TRUE(all_equal(this->read(this->buffer_, this->bytes), 0x7C));
}

TYPED_TEST(stream_event, destroyed_or_foreign_streams_and_events_are_refused) {
  auto& dev = this->device();
  const backend::stream_ref s = dev.create_stream();
  dev.destroy_stream(s);
  EXPECT_THROW(dev.destroy_stream(s), invalid_argument);
  EXPECT_THROW(dev.fill(s, this->buffer_, 0, 16), invalid_argument);
  EXPECT_THROW(dev.synchronize(s), invalid_argument);
  EXPECT_THROW(dev.destroy_stream(backend::stream_ref{}), invalid_argument) << "the default stream is not destroyable";
  int not_a_stream = 0;
  EXPECT_THROW(dev.synchronize(backend::stream_ref{&not_a_stream}), invalid_argument);

  const backend::event_ref e = dev.create_event();
  dev.destroy_event(e);
  EXPECT_THROW(dev.destroy_event(e), invalid_argument);
  EXPECT_THROW(dev.record(e, {}), invalid_argument);
  EXPECT_THROW((void)dev.query_event(e), invalid_argument);
  EXPECT_THROW(dev.wait({}, e), invalid_argument);
}

// A held stream outlives its destroy_stream until the last release: it stays
// usable, a second destroy is refused as for a destroyed stream, and the
// last release destroys it.
TYPED_TEST(stream_event, a_held_stream_is_destroyed_at_its_last_release) {
  auto& dev = this->device();
  const backend::stream_ref s = dev.create_stream();
  dev.hold_stream(s);
  dev.hold_stream(s);
  dev.destroy_stream(s);
  EXPECT_THROW(dev.destroy_stream(s), invalid_argument) << "destroyed already, if later";
  dev.fill(s, this->buffer_, 0x5A, this->bytes);
  dev.synchronize(s);
  EXPECT_TRUE(all_equal(this->read(this->buffer_, this->bytes), 0x5A)) << "still a stream: its work runs";
  dev.release_stream(s);
  EXPECT_TRUE(dev.query(s)) << "one hold left";
  dev.release_stream(s);
  EXPECT_THROW(dev.synchronize(s), invalid_argument) << "the last release destroyed it";
  EXPECT_THROW(dev.release_stream(s), invalid_argument) << "no hold is left";
}

// A hold with no destroy meanwhile changes nothing at its release: the stream
// lives on until its owner destroys it, at once. The default stream can be
// held too, and is never destroyed.
TYPED_TEST(stream_event, a_stream_released_before_its_destroy_is_destroyed_at_once) {
  auto& dev = this->device();
  const backend::stream_ref s = dev.create_stream();
  dev.hold_stream(s);
  dev.release_stream(s);
  dev.synchronize(s);
  dev.destroy_stream(s);
  EXPECT_THROW(dev.synchronize(s), invalid_argument);
  dev.hold_stream({});
  EXPECT_THROW(dev.destroy_stream(backend::stream_ref{}), invalid_argument) << "the default stream, held or not";
  dev.release_stream({});
  dev.synchronize({});
}

TYPED_TEST(stream_event, many_threads_enqueue_and_wait_at_once) {
  // Each thread owns a stream and hands its buffer region to the next
  // thread's stream through an event; run under TSan in CI.
  auto& dev = this->device();
  constexpr int threads = 4;
  constexpr int rounds = 50;
  constexpr std::size_t slice = TestFixture::bytes / threads;
  std::vector<std::thread> workers;
  std::atomic<int> failures{0};
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      stream mine(dev);
      stream other(dev);
      event done(dev);
      auto* region = static_cast<std::uint8_t*>(this->buffer_) + t * slice;
      std::vector<std::uint8_t> out(slice);
      for (int r = 0; r < rounds; ++r) {
        const auto value = static_cast<std::uint8_t>(r * threads + t);
        dev.fill(mine, region, value, slice);
        done.record(mine);
        dev.wait(other, done);
        dev.copy(other, out.data(), region, slice);
        dev.synchronize(other);
        if (!all_equal(out, value)) failures.fetch_add(1);
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0);
}

TYPED_TEST(stream_event, small_reads_into_host_memory_wait_for_queued_writes) {
  // Reads of a few bytes into ordinary (pageable) host memory, as a consumer
  // reads a scalar back: from several threads at once, each read must see
  // the fill queued before it behind a delay, from one byte to past 64 KiB.
  auto& dev = this->device();
  constexpr int threads = 4;
  constexpr std::size_t sizes[] = {1, 100, 4096, 64 << 10, (64 << 10) + 1};
  constexpr std::size_t slice = TestFixture::bytes / threads;
  static_assert(slice >= (64 << 10) + 1);
  std::vector<std::thread> workers;
  std::atomic<int> failures{0};
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      stream mine(dev);
      auto* region = static_cast<std::uint8_t*>(this->buffer_) + t * slice;
      int round = 0;
      for (std::size_t n : sizes) {
        const auto value = static_cast<std::uint8_t>(1 + t * 16 + round++);
        std::vector<std::uint8_t> out(n, 0);
        dev.delay(mine, 2ms);
        dev.fill(mine, region, value, n);
        dev.copy(mine, out.data(), region, n);
        dev.synchronize(mine);
        if (!all_equal(out, value)) failures.fetch_add(1);
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace shoal::testing
