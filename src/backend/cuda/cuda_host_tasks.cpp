#include "backend/cuda/cuda_host_tasks.h"

#include <exception>
#include <utility>

#include "backend/cuda/cuda_driver.h"
#include "core/address_text.h"

namespace shoal::backend::detail {

namespace {

using shoal::detail::hex;

struct host_task_call {
  std::function<void()> task;
  std::shared_ptr<cuda_task_failures> failures;
  cudaStream_t stream;
};

// Runs on a CUDA-owned thread: nothing may escape into the runtime.
void CUDART_CB run_host_task(void* data) noexcept {
  const std::unique_ptr<host_task_call> call(static_cast<host_task_call*>(data));
  try {
    call->task();
  } catch (const std::exception& e) {
    call->failures->record(call->stream, e.what());
  } catch (...) {
    call->failures->record(call->stream, "an exception not derived from std::exception");
  }
}

}  // namespace

void cuda_task_failures::record(cudaStream_t stream, const char* what) noexcept {
  try {
    std::lock_guard lock(mutex);
    first.try_emplace(stream, "a host task on " + (stream == nullptr ? "the default stream" : "stream " + hex(stream)) +
                                  " threw: " + what);
  } catch (...) {
    // Out of memory while recording: the failure is lost rather than thrown
    // into the CUDA runtime.
  }
}

std::optional<std::string> cuda_task_failures::take(cudaStream_t stream) {
  std::lock_guard lock(mutex);
  const auto it = first.find(stream);
  if (it == first.end()) return std::nullopt;
  std::string message = std::move(it->second);
  first.erase(it);
  return message;
}

void cuda_task_failures::forget(cudaStream_t stream) {
  std::lock_guard lock(mutex);
  first.erase(stream);
}

void launch_host_task(cudaStream_t stream, std::function<void()> task, std::shared_ptr<cuda_task_failures> failures) {
  auto call = std::make_unique<host_task_call>(host_task_call{std::move(task), std::move(failures), stream});
  check(cudaLaunchHostFunc(stream, run_host_task, call.get()), "cudaLaunchHostFunc");
  call.release();  // run_host_task owns it now
}

}  // namespace shoal::backend::detail
