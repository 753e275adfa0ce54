// Device kernels of the CUDA backend and their host-side launchers.
//
// Each launcher enqueues its kernel on `stream` (nullptr: the legacy default
// stream) and returns at once. A failed launch throws shoal::backend_error.
// Thread-safety: callable from any thread; the caller has made its device
// current.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>

namespace shoal::backend::detail {

/// A one-thread kernel that keeps `stream` busy for `duration` (>= 0).
void launch_spin(cudaStream_t stream, std::chrono::microseconds duration);

}  // namespace shoal::backend::detail
