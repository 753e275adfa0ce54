#include "oom_observers.h"

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <utility>

namespace shoal_torch {

void oom_observers::attach(observer o) {
  std::lock_guard lock(mutex_);
  observers_.push_back(std::move(o));
}

void oom_observers::notify(int device, size_t bytes, double memory_fraction) const noexcept {
  std::vector<observer> told;
  try {
    {
      std::lock_guard lock(mutex_);
      if (observers_.empty()) return;
      told = observers_;  // called with no lock held: an observer may take a snapshot, or attach another
    }
    size_t free = 0, total = 0;
    {
      const c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(device));
      if (cudaMemGetInfo(&free, &total) != cudaSuccess) (void)cudaGetLastError();
    }
    const size_t limit = memory_fraction > 0 && memory_fraction < 1
                             ? static_cast<size_t>(memory_fraction * static_cast<double>(total))
                             : total;
    for (const observer& o : told) {
      try {
        o(device, bytes, limit, free);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "shoal: an out-of-memory observer failed: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "shoal: an out-of-memory observer failed\n");
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal: telling the out-of-memory observers failed: %s\n", e.what());
  }
}

}  // namespace shoal_torch
