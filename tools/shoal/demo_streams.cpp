// [streams]: a batch loaded on a side stream, read and dropped on the model's
// stream by the model's thread. The free knows its stream, so the block is
// not handed out again while the read is queued; with cross_stream_safety
// off it is, and the read sees the next batch's bytes; debug mode catches it.
#include <cstdio>
#include <exception>
#include <thread>

#include "shoal/core/error.h"
#include "tools/shoal/demo_steps.h"

namespace shoal::tools::demo {

namespace {

using namespace std::chrono_literals;

constexpr std::size_t batch_bytes = 4 << 20;
constexpr auto read_time = 150ms;  // the model's "kernel" reading the batch
constexpr std::uint8_t first_batch = 0x11;
constexpr std::uint8_t second_batch = 0x22;

/// The loader (this thread): a batch from `allocator` on the loader stream,
/// filled there; `written` marks the fill.
void* load_batch(backend::device& dev, alloc::caching_allocator& allocator, demo_streams& s, backend::event& written) {
  void* batch = allocator.allocate(batch_bytes, s.loader);
  dev.fill(s.loader, batch, first_batch, batch_bytes);
  written.record(s.loader);
  return batch;
}

/// Where the model's read of a batch lands: device memory, so the read is
/// stream-ordered on every backend (a copy into pageable host memory blocks
/// the calling thread until it has run, on CUDA).
class model_read {
 public:
  explicit model_read(backend::device& dev) : dev_(dev), buffer_(dev.allocate_segment(batch_bytes)) {}
  ~model_read() { dev_.free_segment(buffer_); }
  model_read(const model_read&) = delete;
  model_read& operator=(const model_read&) = delete;

  [[nodiscard]] void* target() const noexcept { return buffer_; }
  /// What the read saw, once the model stream has passed it.
  [[nodiscard]] std::vector<std::uint8_t> bytes() const { return read_back(dev_, buffer_, batch_bytes, {}); }

 private:
  backend::device& dev_;
  void* buffer_;
};

/// The model's thread, whose current stream is the model stream: waits for
/// the load, reads the batch into `seen` after a long kernel, and drops it
/// without naming a stream. Returns once all of that is enqueued.
void read_and_drop(backend::device& dev, alloc::caching_allocator& allocator, demo_streams& s, backend::event& written,
                   void* batch, const model_read& seen) {
  std::exception_ptr failure;
  std::thread model_thread([&] {
    try {
      backend::stream_guard on_model(dev, s.model);
      dev.wait(s.model, written);
      dev.delay(s.model, read_time);
      dev.copy(s.model, seen.target(), batch, batch_bytes);
      allocator.deallocate(batch);  // frees on this thread's current stream: the model's
    } catch (...) {
      failure = std::current_exception();
    }
  });
  model_thread.join();
  if (failure) std::rethrow_exception(failure);
}

void safe_by_default(backend::device& dev, alloc::caching_allocator& allocator, demo_streams& s) {
  backend::event written(dev);
  const model_read seen(dev);
  void* batch = load_batch(dev, allocator, s, written);
  read_and_drop(dev, allocator, s, written, batch, seen);
  void* next = allocator.allocate(batch_bytes, s.loader);
  const bool read_queued = !dev.query(s.model);
  dev.fill(s.loader, next, second_batch, batch_bytes);
  s.model.synchronize();
  const bool read_intact = all_are(seen.bytes(), first_batch);
  allocator.process_pending_frees();
  void* after = allocator.allocate(batch_bytes, s.loader);
  std::printf("[streams] safe (default): batch %s freed on the model stream while its %lld ms read was %s; the loader's "
              "next batch got %s, a different block\n",
              hex(batch).c_str(), static_cast<long long>(read_time.count()), read_queued ? "still queued" : "done",
              hex(next).c_str());
  std::printf("[streams]   the read saw the batch intact: %s; once the model passed it, the loader got %s back\n",
              read_intact ? "yes" : "NO", hex(after).c_str());
  allocator.deallocate(next, s.loader);
  allocator.deallocate(after, s.loader);
  expect(read_queued, "the model stream finished its read before the next allocation; too loaded a machine to show it");
  expect(next != batch, "the safe allocator handed out a block the model stream was still reading");
  expect(read_intact, "the model's read of the batch saw other bytes");
  expect(after == batch, "the freed batch did not come back once the model stream had passed it");
}

/// The unsafe modes' common start: an allocator with cross-stream safety off
/// (and `debug` as asked), a batch loaded on the loader stream, read and
/// dropped by the model's thread, its read still queued.
struct dropped_batch {
  dropped_batch(backend::device& dev, demo_streams& s, bool debug)
      : allocator(dev, unsafe_config(debug)), seen(dev), settle{s}, written(dev) {
    batch = load_batch(dev, allocator, s, written);
    read_and_drop(dev, allocator, s, written, batch, seen);
  }
  static alloc::allocator_config unsafe_config(bool debug) {
    alloc::allocator_config c;
    c.cross_stream_safety = false;
    c.debug = debug;
    return c;
  }

  alloc::caching_allocator allocator;
  const model_read seen;   // outlives `settle`: the streams pass the read before it goes
  settle_streams settle;
  backend::event written;
  void* batch = nullptr;
};

void unsafe_mode(backend::device& dev, demo_streams& s) {
  dropped_batch dropped(dev, s, false);
  auto& allocator = dropped.allocator;
  const auto& seen = dropped.seen;
  void* const batch = dropped.batch;
  void* next = allocator.allocate(batch_bytes, s.loader);
  const bool read_queued = !dev.query(s.model);
  dev.fill(s.loader, next, second_batch, batch_bytes);
  s.model.synchronize();
  const std::size_t overwritten = count_of(seen.bytes(), second_batch);
  allocator.deallocate(next, s.loader);
  std::printf("[streams] unsafe (cross_stream_safety:false): the loader's next batch got %s, the same block, while the "
              "read was %s; the read saw %s of the next batch's bytes\n",
              hex(next).c_str(), read_queued ? "still queued" : "done", mib(static_cast<std::int64_t>(overwritten)).c_str());
  expect(read_queued, "the model stream finished its read before the next allocation; too loaded a machine to show it");
  expect(next == batch, "cross_stream_safety:false did not hand the block straight back");
}

void debug_mode(backend::device& dev, demo_streams& s) {
  dropped_batch dropped(dev, s, true);
  auto& allocator = dropped.allocator;
  std::string caught;
  try {
    void* next = allocator.allocate(batch_bytes, s.loader);
    allocator.deallocate(next, s.loader);
  } catch (const ordering_violation& e) {
    caught = e.what();
  }
  s.model.synchronize();
  std::printf("[streams] with debug:true too, the hand-out raised ordering_violation: %s\n",
              caught.empty() ? "NOTHING" : caught.c_str());
  expect(!caught.empty(), "debug mode did not detect a block handed out while the model stream could still read it");
}

}  // namespace

void show_streams(backend::device& dev, alloc::caching_allocator& allocator, demo_streams& streams) {
  safe_by_default(dev, allocator, streams);
  unsafe_mode(dev, streams);
  debug_mode(dev, streams);
}

}  // namespace shoal::tools::demo
