// shoal's caching allocator side by side with PyTorch's, cudaMallocAsync,
// cudaMalloc and (when built with it) RMM's pool and arena, in one process
// run on CUDA device 0, every allocator through the same loops:
//   (a) a cached allocate+deallocate pair on one thread, by size;
//   (b) 10,000 mixed blocks (512 B .. 1 MiB): PyTorch's anchor loop
//       (allocate all, free all), and one pair while they all stay live;
//   (c) N threads, each on its own stream, doing pairs: aggregate pairs/s;
//   (d) a stream per request: make a stream, allocate a request's blocks on
//       it, free them, destroy the stream; time per request and the peak
//       reserved, beside making and destroying a stream alone.
// Pairs are timed in batches (one clock read per batch, not per pair, so the
// clock does not dominate a 0.1 µs pair); a figure is the median over
// batches or repetitions. cudaMalloc takes part in (a) only, with fewer
// pairs, since every pair goes to the driver.
//
// Prints a markdown table last, and writes it to $OUT/compare.md when OUT is
// set. SHOAL_ALLOC_CONF configures shoal (default: cross-stream safety on);
// SHOAL_COMMIT names the commit in the table's header.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/shoal_adapter.h"
#include "bench/common/shoal_per_stream_adapter.h"
#include "bench/common/private_work_adapter.h"
#include "bench/compare/adapters.h"
#include "shoal/backend/devices.h"

#ifdef SHOAL_BENCH_WITH_TORCH
#include <torch/headeronly/version.h>
#endif

namespace {

using shoal::bench::allocator_adapter;
using steady = std::chrono::steady_clock;

constexpr int live_blocks = 10'000;
constexpr int thread_counts[] = {1, 2, 4, 8, 16};
constexpr std::size_t pair_sizes[] = {512, std::size_t{64} << 10, std::size_t{2} << 20, std::size_t{64} << 20};

// 512 B .. 1 MiB, the mix of PyTorch's anchor with many live blocks.
std::size_t mixed_size(int i) { return std::size_t{512} << (i % 12); }
// The sizes each thread of (c) cycles through.
std::size_t thread_size(int i) { return 4096 + 512 * static_cast<std::size_t>(i & 7); }

double micros(steady::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

struct batch_plan {
  int warmup_batches;
  int batches;  // odd, so the median is one of them
  int pairs_per_batch;
};
constexpr batch_plan cached_plan{2, 101, 1000};
constexpr batch_plan driver_plan{1, 21, 10};
constexpr batch_plan live_plan{2, 51, 1000};
constexpr int live_repetitions = 5;
// Runs of every thread count, interleaved (1, 2, 4, 8, 16, 1, 2, ...), so a
// slow spell of the machine does not land on one count only.
constexpr int thread_repetitions = 9;
constexpr auto thread_run_time = std::chrono::milliseconds(200);

// Median over batches of one pair's time, in µs; pair i has size_of(i) bytes.
template <class SizeOf>
double pair_us(allocator_adapter& a, void* stream, SizeOf size_of, const batch_plan& plan) {
  std::vector<double> per_pair;
  int i = 0;
  for (int b = 0; b < plan.warmup_batches + plan.batches; ++b) {
    const auto start = steady::now();
    for (int k = 0; k < plan.pairs_per_batch; ++k, ++i) {
      const std::size_t bytes = size_of(i);
      a.deallocate(a.allocate(bytes, stream), bytes, stream);
    }
    const auto end = steady::now();
    if (b >= plan.warmup_batches) per_pair.push_back(micros(end - start) / plan.pairs_per_batch);
  }
  return median(per_pair);
}

// PyTorch's anchor loop: allocate 10,000 mixed blocks, free them all; the
// median over repetitions (after one that fills the cache) of the time per pair.
double alloc_all_free_all_us(allocator_adapter& a, void* stream) {
  std::vector<void*> blocks(live_blocks);
  std::vector<double> per_pair;
  for (int r = 0; r <= live_repetitions; ++r) {
    const auto start = steady::now();
    for (int i = 0; i < live_blocks; ++i) blocks[i] = a.allocate(mixed_size(i), stream);
    for (int i = 0; i < live_blocks; ++i) a.deallocate(blocks[i], mixed_size(i), stream);
    const auto end = steady::now();
    if (r > 0) per_pair.push_back(micros(end - start) / live_blocks);
  }
  return median(per_pair);
}

double pair_with_live_blocks_us(allocator_adapter& a, void* stream) {
  std::vector<void*> blocks(live_blocks);
  for (int i = 0; i < live_blocks; ++i) blocks[i] = a.allocate(mixed_size(i), stream);
  const double us = pair_us(a, stream, mixed_size, live_plan);
  for (int i = 0; i < live_blocks; ++i) a.deallocate(blocks[i], mixed_size(i), stream);
  return us;
}

// Aggregate pairs per second of `threads` threads, each on its own stream,
// running together for thread_run_time (one run).
double threads_pairs_per_s(allocator_adapter& a, const std::vector<void*>& streams, int threads) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> pairs{0};
  std::exception_ptr failure;  // the first thread's error, rethrown once all have stopped
  std::mutex failure_mutex;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, stream = streams[t]] {
      bool counted_ready = false;
      try {
        int i = 0;
        for (; i < 1000; ++i) a.deallocate(a.allocate(thread_size(i), stream), thread_size(i), stream);
        ready.fetch_add(1);
        counted_ready = true;
        while (!go.load(std::memory_order_acquire)) {
        }
        std::uint64_t done = 0;
        // The stop flag is read once per 64 pairs, so that reading it costs nothing.
        while (!stop.load(std::memory_order_relaxed)) {
          for (int k = 0; k < 64; ++k, ++i) a.deallocate(a.allocate(thread_size(i), stream), thread_size(i), stream);
          done += 64;
        }
        pairs.fetch_add(done);
      } catch (...) {
        const std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        if (!counted_ready) ready.fetch_add(1);
      }
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const auto start = steady::now();
  go.store(true, std::memory_order_release);
  std::this_thread::sleep_for(thread_run_time);
  stop.store(true, std::memory_order_relaxed);
  for (std::thread& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
  const double seconds = std::chrono::duration<double>(steady::now() - start).count();
  return static_cast<double>(pairs.load()) / seconds;
}

// A request of (d): its blocks' sizes (a model step's activations).
constexpr std::size_t request_sizes[] = {std::size_t{1} << 20, std::size_t{4} << 20, std::size_t{16} << 20};
constexpr batch_plan request_plan{2, 21, 25};

// Median over batches of one request's time, in µs, each request on a
// stream of its own that it makes and destroys.
double stream_per_request_us(allocator_adapter& a) {
  std::vector<double> per_request;
  void* blocks[std::size(request_sizes)];
  for (int b = 0; b < request_plan.warmup_batches + request_plan.batches; ++b) {
    const auto start = steady::now();
    for (int k = 0; k < request_plan.pairs_per_batch; ++k) {
      void* stream = a.create_stream();
      for (std::size_t j = 0; j < std::size(request_sizes); ++j) blocks[j] = a.allocate(request_sizes[j], stream);
      for (std::size_t j = 0; j < std::size(request_sizes); ++j) a.deallocate(blocks[j], request_sizes[j], stream);
      a.destroy_stream(stream);
    }
    const auto end = steady::now();
    if (b >= request_plan.warmup_batches) per_request.push_back(micros(end - start) / request_plan.pairs_per_batch);
  }
  return median(per_request);
}

// The anchor of (d): making and destroying a CUDA stream, nothing allocated.
double stream_alone_us() {
  std::vector<double> per_stream;
  for (int b = 0; b < request_plan.warmup_batches + request_plan.batches; ++b) {
    const auto start = steady::now();
    for (int k = 0; k < request_plan.pairs_per_batch; ++k) {
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return -1;
      cudaStreamDestroy(stream);
    }
    const auto end = steady::now();
    if (b >= request_plan.warmup_batches) per_stream.push_back(micros(end - start) / request_plan.pairs_per_batch);
  }
  return median(per_stream);
}

// ---- the results table ------------------------------------------------------

enum class better { lower, higher };

struct row {
  std::string label;
  better direction;
  std::map<std::string, double> value;        // by allocator
  std::map<std::string, std::string> suffix;  // by allocator, e.g. "(7.1×)"
};

class table {
 public:
  /// The new row; it stays where it is while later rows are added.
  row& add(std::string label, better direction) {
    rows_.push_back(row{std::move(label), direction, {}, {}});
    return rows_.back();
  }
  void note_error(const std::string& allocator, const std::string& what) { errors_[allocator] = what; }

  [[nodiscard]] std::string markdown(const std::vector<std::string>& allocators) const {
    std::ostringstream out;
    out << "| measurement |";
    for (const std::string& a : allocators) out << ' ' << a << " |";
    out << " shoal vs torch |\n| --- |";
    for (std::size_t i = 0; i <= allocators.size(); ++i) out << " ---: |";
    out << '\n';
    for (const row& r : rows_) {
      out << "| " << r.label << " |";
      for (const std::string& a : allocators) out << ' ' << cell(r, a) << " |";
      out << ' ' << shoal_vs_torch(r) << " |\n";
    }
    for (const auto& [allocator, what] : errors_) out << "\n" << allocator << " failed: " << what << '\n';
    return out.str();
  }

 private:
  static std::string format(double v) {
    char text[32];
    std::snprintf(text, sizeof text, v >= 100 ? "%.0f" : v >= 10 ? "%.1f" : v >= 1 ? "%.2f" : "%.3f", v);
    return text;
  }
  static std::string cell(const row& r, const std::string& allocator) {
    const auto v = r.value.find(allocator);
    if (v == r.value.end()) return "—";
    const auto s = r.suffix.find(allocator);
    return format(v->second) + (s == r.suffix.end() ? "" : " " + s->second);
  }
  // How many times better shoal is than PyTorch on this row.
  static std::string shoal_vs_torch(const row& r) {
    const auto s = r.value.find("shoal");
    const auto t = r.value.find("torch");
    if (s == r.value.end() || t == r.value.end() || s->second <= 0 || t->second <= 0) return "—";
    return format(r.direction == better::lower ? t->second / s->second : s->second / t->second) + "×";
  }

  std::deque<row> rows_;
  std::map<std::string, std::string> errors_;
};

std::string size_label(std::size_t bytes) {
  if (bytes >= (std::size_t{1} << 20)) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= 1024) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

struct contender {
  std::string name;
  std::function<std::unique_ptr<allocator_adapter>()> make;
  bool driver_only;  // every pair goes to the driver: (a) only, with fewer pairs
};

std::vector<contender> contenders() {
  std::vector<contender> list;
  list.push_back({"shoal",
                  [] {
                    return std::make_unique<shoal::bench::shoal_adapter>(
                        shoal::backend::cuda_device_instance(0), shoal::alloc::allocator_config::from_environment());
                  },
                  false});
#ifdef SHOAL_BENCH_WITH_TORCH
  list.push_back({"torch", [] { return std::make_unique<shoal::bench::torch_adapter>(); }, false});
#endif
  list.push_back({"cudaMallocAsync", [] { return std::make_unique<shoal::bench::cuda_async_adapter>(); }, false});
  list.push_back({"cudaMalloc", [] { return std::make_unique<shoal::bench::cuda_malloc_adapter>(); }, true});
#ifdef SHOAL_BENCH_WITH_RMM
  list.push_back({"rmm pool", [] { return std::make_unique<shoal::bench::rmm_pool_adapter>(); }, false});
  list.push_back({"rmm arena", [] { return std::make_unique<shoal::bench::rmm_arena_adapter>(); }, false});
#endif
  // Not ways to use an allocator: ceilings for the thread rows. shoal with an
  // allocator per stream shares nothing; private work does no memory work.
  list.push_back({"shoal per stream",
                  [] {
                    return std::make_unique<shoal::bench::shoal_per_stream_adapter>(
                        shoal::backend::cuda_device_instance(0), shoal::alloc::allocator_config::from_environment());
                  },
                  false});
  list.push_back({"private work", [] { return std::make_unique<shoal::bench::private_work_adapter>(); }, false});
  return list;
}

std::string header() {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  const char* commit = std::getenv("SHOAL_COMMIT");
  std::string text = std::string("compare_allocators, ") + date + ", " + prop.name + ", shoal " +
                     (commit ? commit : "(commit unknown)") + " [" +
                     shoal::alloc::allocator_config::from_environment().to_string() + "]";
#ifdef SHOAL_BENCH_WITH_TORCH
  text += ", torch " TORCH_VERSION;
#endif
#ifdef SHOAL_BENCH_WITH_RMM
  text += ", rmm " RMM_VERSION;
#endif
  text += "\npair: µs (median over batches); threads: M pairs/s aggregate (× one thread); "
          "shoal vs torch: how many times better shoal is; private work: not an allocator but 32 xorshift rounds per "
          "pair on thread-private state, the machine's ceiling for the thread rows; shoal per stream: an allocator of "
          "its own for each stream, nothing shared, shoal's own ceiling there\n";
  return text;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "compare_allocators: no CUDA device (%s)\n", shoal::backend::cuda_unavailable_reason().c_str());
    return 1;
  }

  table results;
  std::vector<row*> pair_rows;
  for (std::size_t bytes : pair_sizes) pair_rows.push_back(&results.add("pair " + size_label(bytes) + ", µs", better::lower));
  row& all_free_row = results.add("10,000 mixed blocks, allocate all then free all, µs per pair", better::lower);
  row& live_row = results.add("pair with 10,000 live mixed blocks, µs", better::lower);
  row& peak_row = results.add("peak reserved with 10,000 mixed blocks, MiB", better::lower);
  std::vector<row*> thread_rows;
  for (int n : thread_counts) {
    thread_rows.push_back(&results.add(std::to_string(n) + (n == 1 ? " thread" : " threads") + ", own streams, M pairs/s",
                                       better::higher));
  }

  row& request_row =
      results.add("a stream per request (make it, 1 + 4 + 16 MiB, free, destroy it), µs per request", better::lower);
  row& request_peak_row = results.add("peak reserved, a stream per request, MiB", better::lower);
  row& request_calls_row = results.add("device allocations, a stream per request", better::lower);

  std::vector<std::string> names;
  for (const contender& c : contenders()) {
    names.push_back(c.name);
    std::fprintf(stderr, "compare_allocators: %s\n", c.name.c_str());
    try {
      {  // (a)
        auto a = c.make();
        void* stream = a->create_stream();
        for (std::size_t k = 0; k < std::size(pair_sizes); ++k) {
          const std::size_t bytes = pair_sizes[k];
          const double us = pair_us(*a, stream, [bytes](int) { return bytes; }, c.driver_only ? driver_plan : cached_plan);
          pair_rows[k]->value[c.name] = us;
        }
        a->synchronize();
      }
      if (c.driver_only) continue;
      {  // (b)
        auto a = c.make();
        void* stream = a->create_stream();
        all_free_row.value[c.name] = alloc_all_free_all_us(*a, stream);
        live_row.value[c.name] = pair_with_live_blocks_us(*a, stream);
        a->synchronize();
        peak_row.value[c.name] = static_cast<double>(a->peak_reserved_bytes()) / (1 << 20);
      }
      {  // (c)
        auto a = c.make();
        std::vector<void*> streams;
        const int max_threads = thread_counts[std::size(thread_counts) - 1];
        for (int t = 0; t < max_threads; ++t) streams.push_back(a->create_stream());
        std::vector<std::vector<double>> runs(std::size(thread_counts));
        for (int r = 0; r < thread_repetitions; ++r) {
          for (std::size_t k = 0; k < std::size(thread_counts); ++k) {
            runs[k].push_back(threads_pairs_per_s(*a, streams, thread_counts[k]));
          }
        }
        double one_thread = 0;
        for (std::size_t k = 0; k < std::size(thread_counts); ++k) {
          const double rate = median(runs[k]);
          if (k == 0) one_thread = rate;
          thread_rows[k]->value[c.name] = rate / 1e6;
          if (k > 0) {
            char ratio[32];
            std::snprintf(ratio, sizeof ratio, "(%.2f×)", rate / one_thread);
            thread_rows[k]->suffix[c.name] = ratio;
          }
        }
        a->synchronize();
      }
      {  // (d)
        auto a = c.make();
        request_row.value[c.name] = stream_per_request_us(*a);
        a->synchronize();
        request_peak_row.value[c.name] = static_cast<double>(a->peak_reserved_bytes()) / (1 << 20);
        if (const std::int64_t calls = a->device_allocations(); calls >= 0) {
          request_calls_row.value[c.name] = static_cast<double>(calls);
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "compare_allocators: %s failed: %s\n", c.name.c_str(), e.what());
      results.note_error(c.name, e.what());
    }
  }

  char anchor[192];
  std::snprintf(anchor, sizeof anchor,
                "making and destroying a CUDA stream alone (the anchor of the stream-per-request rows): %.2f µs\n",
                stream_alone_us());
  const std::string text = header() + anchor + "\n" + results.markdown(names);
  std::fputs(("\n" + text).c_str(), stdout);
  if (const char* out = std::getenv("OUT")) {
    std::ofstream file(std::string(out) + "/compare.md");
    file << text;
  }
  return 0;
}
