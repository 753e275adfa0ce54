#include "cuda_kernels.h"

#include <cstdint>
#include <limits>

#include "cuda_driver.h"

namespace shoal::backend::detail {

namespace {

__device__ std::uint64_t global_time_ns() {
  std::uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// %globaltimer is wall-clock nanoseconds, so the delay does not depend on the
// SM clock rate. The nap keeps the spinning warp from taking issue slots
// from kernels sharing the SM.
__global__ void spin_kernel(std::uint64_t nanoseconds) {
  const std::uint64_t start = global_time_ns();
  while (global_time_ns() - start < nanoseconds) __nanosleep(1000);
}

}  // namespace

void launch_spin(cudaStream_t stream, std::chrono::microseconds duration) {
  constexpr auto max_us = std::numeric_limits<std::uint64_t>::max() / 1000;
  const auto us = static_cast<std::uint64_t>(duration.count());
  spin_kernel<<<1, 1, 0, stream>>>(us > max_us ? std::numeric_limits<std::uint64_t>::max() : us * 1000);
  check(cudaGetLastError(), "spin kernel launch");
}

}  // namespace shoal::backend::detail
