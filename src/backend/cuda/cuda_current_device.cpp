#include "backend/cuda/cuda_current_device.h"

#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_driver.h"

namespace shoal::backend::detail {

void make_current(int ordinal) {
  // cudaGetDevice reports 0 on a thread that never chose a device, without
  // making a context current there; the driver calls need one. So each
  // thread sets the device once, and again when it finds it changed.
  thread_local int set_on_this_thread = -1;
  int current = -1;
  if (set_on_this_thread == ordinal && cudaGetDevice(&current) == cudaSuccess && current == ordinal) return;
  check(cudaSetDevice(ordinal), "cudaSetDevice");
  set_on_this_thread = ordinal;
}

std::string cuda_label(int ordinal) { return "cuda device " + std::to_string(ordinal); }

}  // namespace shoal::backend::detail
