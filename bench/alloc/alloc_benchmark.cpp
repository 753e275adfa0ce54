// The caching allocator's hot paths, on backend::default_device(): the
// first CUDA GPU when there is one, else the host backend (where the figures
// show the allocator's own cost, since a host segment is cheap to take).
//
// Every benchmark uses allocator_config::from_environment(), so the default
// settings (cross-stream safety on) unless SHOAL_ALLOC_CONF says otherwise,
// and frees on the calling thread's current stream, as users do.
// items_per_second is allocate+deallocate pairs per second; the thread
// benchmark reports it summed over threads (wall-clock time).

#include <benchmark/benchmark.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"

namespace {

using shoal::alloc::allocator_config;
using shoal::alloc::caching_allocator;
namespace backend = shoal::backend;

constexpr int live_blocks = 10'000;
constexpr int max_threads = 16;

backend::device& bench_device() { return backend::default_device(); }

// 512 B .. 1 MiB, the mix of PyTorch's anchor with many live blocks.
std::size_t mixed_size(int i) { return std::size_t{512} << (i % 12); }

// The sizes each thread of the thread benchmark cycles through.
std::size_t thread_size(int i) { return 4096 + 512 * static_cast<std::size_t>(i & 7); }

void BM_cached_pair(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  caching_allocator allocator(bench_device(), allocator_config::from_environment());
  allocator.deallocate(allocator.allocate(bytes));  // takes the segment, so the loop only reuses it
  for (auto _ : state) {
    void* p = allocator.allocate(bytes);
    benchmark::DoNotOptimize(p);
    allocator.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_cached_pair)
    ->Arg(512)
    ->Arg(64 << 10)
    ->Arg(2 << 20)
    ->Arg(64 << 20)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

// One pair (cycling through the mix) while 10,000 mixed blocks stay live.
void BM_pair_with_live_blocks(benchmark::State& state) {
  caching_allocator allocator(bench_device(), allocator_config::from_environment());
  std::vector<void*> live(live_blocks);
  for (int i = 0; i < live_blocks; ++i) live[i] = allocator.allocate(mixed_size(i));
  for (int i = 0; i < 12; ++i) allocator.deallocate(allocator.allocate(mixed_size(i)));
  int i = 0;
  for (auto _ : state) {
    void* p = allocator.allocate(mixed_size(i++));
    benchmark::DoNotOptimize(p);
    allocator.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
  for (void* p : live) allocator.deallocate(p);
}
BENCHMARK(BM_pair_with_live_blocks)->Repetitions(5)->ReportAggregatesOnly(true);

// A free on another stream than the block's, as a tensor used on a side
// stream is freed: an event recorded there, the block pending until an
// allocation that misses finds the event passed. Arg 1 registers a
// free-wait observer (as the PyTorch plugin does), told twice a pair: what
// telling one costs beside the event.
void BM_free_on_another_stream(benchmark::State& state) {
  caching_allocator allocator(bench_device(), allocator_config::from_environment());
  std::size_t told = 0;
  if (state.range(0) != 0) {
    (void)allocator.add_free_wait_observer([&told](const shoal::alloc::free_wait_event&) { ++told; });
  }
  backend::stream other(bench_device());
  for (auto _ : state) {
    void* p = allocator.allocate(4096);
    benchmark::DoNotOptimize(p);
    allocator.deallocate(p, other);
  }
  state.SetItemsProcessed(state.iterations());
  benchmark::DoNotOptimize(told);
  bench_device().synchronize(other);
  allocator.process_pending_frees();
}
BENCHMARK(BM_free_on_another_stream)->Arg(0)->Arg(1)->Repetitions(5)->ReportAggregatesOnly(true);

// The anchor's loop: allocate 10,000 mixed blocks, then free them all.
// An item is one pair.
void BM_mixed_alloc_all_free_all(benchmark::State& state) {
  caching_allocator allocator(bench_device(), allocator_config::from_environment());
  std::vector<void*> blocks(live_blocks);
  auto round = [&] {
    for (int i = 0; i < live_blocks; ++i) blocks[i] = allocator.allocate(mixed_size(i));
    for (void* p : blocks) allocator.deallocate(p);
  };
  round();  // fills the cache
  for (auto _ : state) round();
  state.SetItemsProcessed(state.iterations() * live_blocks);
}
BENCHMARK(BM_mixed_alloc_all_free_all)->Unit(benchmark::kMicrosecond)->Repetitions(5)->ReportAggregatesOnly(true);

// N threads share one allocator, each on its own stream. Made in Setup
// (before the threads start) and dropped in Teardown. The streams are
// declared first so that they outlive the allocator, which may still use
// them while it returns its segments.
struct thread_fixture {
  std::vector<backend::stream> streams;
  caching_allocator allocator{bench_device(), allocator_config::from_environment()};
};
std::unique_ptr<thread_fixture> fixture;

void make_thread_fixture(const benchmark::State& state) {
  fixture = std::make_unique<thread_fixture>();
  for (int t = 0; t < state.threads(); ++t) fixture->streams.emplace_back(bench_device());
}

void drop_thread_fixture(const benchmark::State&) { fixture.reset(); }

void BM_threads_own_stream(benchmark::State& state) {
  caching_allocator& allocator = fixture->allocator;
  const backend::stream_guard guard(bench_device(), fixture->streams[state.thread_index()]);
  for (int i = 0; i < 8; ++i) allocator.deallocate(allocator.allocate(thread_size(i)));
  int i = 0;
  for (auto _ : state) {
    void* p = allocator.allocate(thread_size(i++));
    benchmark::DoNotOptimize(p);
    allocator.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_threads_own_stream)
    ->Setup(make_thread_fixture)
    ->Teardown(drop_thread_fixture)
    ->ThreadRange(1, max_threads)
    ->UseRealTime()
    ->Repetitions(3)
    ->ReportAggregatesOnly(true);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("shoal_device", bench_device().name());
  benchmark::AddCustomContext("shoal_alloc_conf", allocator_config::from_environment().to_string());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
