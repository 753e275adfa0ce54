// Host tasks on CUDA streams (cudaLaunchHostFunc), and the failures they
// leave for the next synchronize of their stream.
//
// A task runs on a CUDA-owned thread, possibly after the device that
// enqueued it is gone: it shares the failure record (shared_ptr) rather than
// pointing into the device. Nothing a task throws escapes into the runtime.
//
// Thread-safety: every member may be called from any thread (one mutex,
// taken alone).
// Invariant: first[s] is the first failure of a host task on stream s since
// s's last synchronize (or since s was created: a stream created at a
// destroyed stream's address starts with none).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace shoal::backend::detail {

struct cuda_task_failures {
  std::mutex mutex;
  std::unordered_map<cudaStream_t, std::string> first;  // stream -> first failure since its last synchronize

  void record(cudaStream_t stream, const char* what) noexcept;
  std::optional<std::string> take(cudaStream_t stream);
  void forget(cudaStream_t stream);
};

/// Enqueues `task` on `stream`; if it throws, the failure goes to `failures`.
/// The caller has made the device current and keeps `stream` alive through
/// the call. Throws shoal::backend_error when cudaLaunchHostFunc fails.
void launch_host_task(cudaStream_t stream, std::function<void()> task, std::shared_ptr<cuda_task_failures> failures);

}  // namespace shoal::backend::detail
