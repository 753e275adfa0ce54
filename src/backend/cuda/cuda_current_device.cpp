#include "backend/cuda/cuda_current_device.h"

#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_driver.h"

namespace shoal::backend::detail {

device_scope::device_scope(int ordinal) {
  const cuda_driver& d = driver();
  CUcontext current = nullptr;
  check(d.ctx_get_current(&current), "cuCtxGetCurrent");
  // With no context current, cudaGetDevice reports 0 without making one
  // current: only a current context's device counts as chosen.
  int device = -1;
  if (current != nullptr && cudaGetDevice(&device) == cudaSuccess && device == ordinal) return;
  check(cudaSetDevice(ordinal), "cudaSetDevice");
  previous_ = current;
  switched_ = true;
}

device_scope::~device_scope() {
  // A failure leaves this device current; a destructor has no one to tell.
  if (switched_) (void)driver().ctx_set_current(previous_);
}

std::string cuda_label(int ordinal) { return "cuda device " + std::to_string(ordinal); }

}  // namespace shoal::backend::detail
