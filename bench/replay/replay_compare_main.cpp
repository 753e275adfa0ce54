// shoal_replay_compare: replays allocation traces through shoal and, on the
// same traces in the same process, through the allocators it is compared
// with (bench/compare/adapters.h), all on CUDA device 0. Same command line
// as shoal_replay (replay_cli.h). Built by the GPU comparison build only
// (bench/compare; bench/replay/COMPARE.md says how).
//
// Left out: cudaMalloc (no cache: it reserves exactly what is live, so its
// ratio says nothing) and RMM's arena (it takes its whole global arena at
// once, so its peak reserved is the arena's size, not a fragmentation).
#include <cstdlib>
#include <memory>
#include <vector>

#include "bench/compare/adapters.h"
#include "bench/replay/replay_cli.h"

int main(int argc, char** argv) {
  using namespace shoal::bench;
  // shoal on the GPU too, or a clear error: never host memory beside CUDA.
  setenv("SHOAL_BACKEND", "cuda", /*overwrite=*/0);
  std::vector<adapter_factory> others;
#ifdef SHOAL_BENCH_WITH_TORCH
  others.push_back({"torch", [] { return std::make_unique<torch_adapter>(); }});
  others.push_back({"torch expandable", [] { return std::make_unique<torch_adapter>(/*expandable_segments=*/true); }});
#endif
  others.push_back({"cudaMallocAsync", [] { return std::make_unique<cuda_async_adapter>(); }});
#ifdef SHOAL_BENCH_WITH_RMM
  others.push_back({"rmm pool", [] { return std::make_unique<rmm_pool_adapter>(); }});
#endif
  return replay_main(argc, argv, others);
}
