// shoal_bench_stats_reader: what a thread reading the allocator's
// statistics now and then costs the threads that allocate. Each allocating
// thread frees and allocates 512 B on each of its own streams in turn (two
// pools a stream), while one more thread calls stats() every interval
// (none, 1, 10, 100 ms). Prints, per interval, the allocating threads' M
// pairs/s together and the µs one read took: medians over the rounds, with
// min–max.
//
//   shoal_bench_stats_reader [--backend host|cuda] [--threads N]
//                            [--streams N] [--seconds S] [--rounds N]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/spread.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"

namespace {

using namespace shoal;
using clock_type = std::chrono::steady_clock;

struct options {
  std::string backend = "host";
  int threads = 1;
  int streams = 8;
  double seconds = 1.0;
  int rounds = 3;
};

struct round_result {
  double pairs_per_second = 0;
  double micros_per_read = 0;
};

round_result run_round(backend::device& dev, const options& o, std::chrono::microseconds every) {
  alloc::caching_allocator allocator(dev, {});
  std::atomic<bool> stop{false};
  std::atomic<int> ready{0};
  std::vector<long> pairs(static_cast<std::size_t>(o.threads) * 16);  // a cache line each
  std::vector<std::thread> workers;
  for (int t = 0; t < o.threads; ++t) {
    workers.emplace_back([&, t] {
      std::vector<backend::stream_ref> streams;
      for (int s = 0; s < o.streams; ++s) streams.push_back(dev.create_stream());
      // Each pool once, and 16 takes of its lock in a row (its bias), first.
      for (int i = 0; i < 16; ++i) {
        for (auto s : streams) allocator.deallocate(allocator.allocate(512, s), s);
      }
      ++ready;
      long n = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        for (auto s : streams) allocator.deallocate(allocator.allocate(512, s), s);
        n += o.streams;
      }
      pairs[static_cast<std::size_t>(t) * 16] = n;
      for (auto s : streams) dev.destroy_stream(s);
    });
  }
  while (ready.load() < o.threads) std::this_thread::yield();
  const auto start = clock_type::now();
  const auto until = start + std::chrono::duration<double>(o.seconds);
  long reads = 0;
  double read_micros = 0;
  while (clock_type::now() < until) {
    if (every.count() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    std::this_thread::sleep_for(every);
    const auto r0 = clock_type::now();
    const alloc::allocator_stats seen = allocator.stats();
    read_micros += std::chrono::duration<double, std::micro>(clock_type::now() - r0).count();
    ++reads;
    if (seen.allocations.aggregate.current < 0) std::abort();  // keeps the read
  }
  stop = true;
  for (auto& w : workers) w.join();
  const double elapsed = std::chrono::duration<double>(clock_type::now() - start).count();
  long total = 0;
  for (int t = 0; t < o.threads; ++t) total += pairs[static_cast<std::size_t>(t) * 16];
  return {static_cast<double>(total) / elapsed, reads > 0 ? read_micros / static_cast<double>(reads) : 0.0};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    options o;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag == "--backend") o.backend = argv[i + 1];
      else if (flag == "--threads") o.threads = std::max(1, std::atoi(argv[i + 1]));
      else if (flag == "--streams") o.streams = std::max(1, std::atoi(argv[i + 1]));
      else if (flag == "--seconds") o.seconds = std::atof(argv[i + 1]);
      else if (flag == "--rounds") o.rounds = std::max(1, std::atoi(argv[i + 1]));
      else throw invalid_argument("unknown flag " + flag);
    }
    backend::device& dev = o.backend == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
    std::printf("shoal_bench_stats_reader: backend %s (%s), %d allocating thread(s), %d streams each, %d rounds of %.1f s\n\n",
                o.backend.c_str(), dev.name().c_str(), o.threads, o.streams, o.rounds, o.seconds);
    std::printf("| stats() read | M pairs/s, allocating threads | µs a read |\n|---|---|---|\n");
    for (const int every_ms : {0, 1, 10, 100}) {
      std::vector<double> rates, reads;
      for (int r = 0; r < o.rounds; ++r) {
        const round_result got = run_round(dev, o, std::chrono::milliseconds(every_ms));
        rates.push_back(got.pairs_per_second / 1e6);
        reads.push_back(got.micros_per_read);
      }
      const std::string when = every_ms == 0 ? "never" : "every " + std::to_string(every_ms) + " ms";
      const std::string read_cost = every_ms == 0 ? "—" : bench::text(bench::summarize(reads));
      std::printf("| %s | %s | %s |\n", when.c_str(), bench::text(bench::summarize(rates)).c_str(), read_cost.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_stats_reader: %s\n", e.what());
    return 1;
  }
}
