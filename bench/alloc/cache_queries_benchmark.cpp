// The direct queries against a snapshot, with 10,000 mixed blocks live (as
// in BM_pair_with_live_blocks): what PyTorch's cacheInfo and
// torch.multiprocessing's sharing of a tensor cost, against the snapshot
// such a query would otherwise read (every block of every segment copied).

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"

namespace {

using shoal::alloc::allocator_config;
using shoal::alloc::caching_allocator;

constexpr int live_blocks = 10'000;

// 512 B .. 1 MiB, as alloc_benchmark.cpp's mix.
std::size_t mixed_size(int i) { return std::size_t{512} << (i % 12); }

// An allocator holding 10,000 live blocks, with some freed between them.
struct live_set {
  caching_allocator allocator{shoal::backend::default_device(), allocator_config::from_environment()};
  std::vector<void*> live;
  live_set() {
    for (int i = 0; i < live_blocks; ++i) live.push_back(allocator.allocate(mixed_size(i)));
    for (int i = 0; i < live_blocks; i += 7) allocator.deallocate(live[i]);
    std::erase_if(live, [i = 0](void*) mutable { return i++ % 7 == 0; });
  }
  ~live_set() {
    for (void* p : live) allocator.deallocate(p);
  }
  live_set(const live_set&) = delete;
  live_set& operator=(const live_set&) = delete;
};

void BM_snapshot_with_live_blocks(benchmark::State& state) {
  live_set set;
  for (auto _ : state) benchmark::DoNotOptimize(set.allocator.take_snapshot());
}
BENCHMARK(BM_snapshot_with_live_blocks)->Unit(benchmark::kMicrosecond)->Repetitions(3)->ReportAggregatesOnly(true);

void BM_segment_of_allocated_block(benchmark::State& state) {
  live_set set;
  std::size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(set.allocator.segment_of_allocated_block(set.live[i++ % set.live.size()]));
  }
}
BENCHMARK(BM_segment_of_allocated_block)->Repetitions(3)->ReportAggregatesOnly(true);

void BM_largest_free_block(benchmark::State& state) {
  live_set set;
  for (auto _ : state) benchmark::DoNotOptimize(set.allocator.largest_free_block());
}
BENCHMARK(BM_largest_free_block)->Repetitions(3)->ReportAggregatesOnly(true);

}  // namespace
