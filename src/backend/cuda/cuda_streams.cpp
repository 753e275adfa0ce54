#include "backend/cuda/cuda_streams.h"

#include <algorithm>
#include <string>
#include <utility>

#include "backend/cuda/cuda_current_device.h"
#include "backend/cuda/cuda_driver.h"
#include "backend/cuda/cuda_kernels.h"
#include "core/address_text.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {

using shoal::detail::hex;

// check() for calls that wait for or poll device work on `ordinal`: a
// failure of that work names the device.
void check_work(cudaError_t result, const char* call, int ordinal) {
  if (result == cudaSuccess) return;
  if (is_work_failure(result)) {
    cudaGetLastError();
    throw_work_failure(call, describe(result), cuda_label(ordinal));
  }
  check(result, call);
}

}  // namespace

cuda_streams::cuda_streams(int ordinal) : ordinal_(ordinal), task_failures_(std::make_shared<cuda_task_failures>()) {}

void cuda_streams::teardown() noexcept {
  for (cudaStream_t stream : streams_) cudaStreamDestroy(stream);
  for (cudaEvent_t event : events_) cudaEventDestroy(event);
}

// ---- streams ----------------------------------------------------------------------

cuda_streams::locked<cudaStream_t> cuda_streams::lock_stream(stream_ref stream, const char* op) const {
  std::shared_lock lock(streams_mutex_);
  const auto native = static_cast<cudaStream_t>(stream.native);
  if (!stream.is_default() && !streams_.contains(native) && !external_.contains(native)) {
    throw invalid_argument(std::string("cuda_device::") + op + ": stream " + hex(stream.native) +
                           " is not a live stream of " + cuda_label(ordinal_) +
                           " (destroyed, or made by another device)");
  }
  return {std::move(lock), native};
}

stream_ref cuda_streams::create_stream() {
  const device_scope on_device(ordinal_);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  // A host task of a destroyed stream at the same address may have failed
  // after that stream was destroyed; its failure is not this stream's.
  task_failures_->forget(stream);
  std::unique_lock lock(streams_mutex_);
  streams_.insert(stream);
  return stream_ref{stream};
}

stream_ref cuda_streams::adopt_external_stream(void* native) {
  if (native == nullptr) return stream_ref{};
  const auto s = static_cast<cudaStream_t>(native);
  {
    std::shared_lock lock(streams_mutex_);
    if (streams_.contains(s) || external_.contains(s)) return stream_ref{native};
  }
  const device_scope on_device(ordinal_);
  // A capturing stream refuses cudaStreamQuery, and the refusal invalidates
  // its capture: asking whether it captures (legal during a capture) is the
  // only check then, and its device goes unchecked: on the H200, a stream
  // forked inside a capture and adopted with cudaStreamGetDevice still asked
  // saw its capture invalidated, and that was the one call there that is no
  // capture query (2026-11-28; this form not yet run on a GPU).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const char* asked = "cudaStreamIsCapturing";
  cudaError_t queried = cudaStreamIsCapturing(s, &capture);
  const bool capturing = queried == cudaSuccess && capture != cudaStreamCaptureStatusNone;
  if (queried == cudaSuccess && !capturing) {
    asked = "cudaStreamQuery";
    queried = cudaStreamQuery(s);
  }
  if (is_work_failure(queried)) check_work(queried, asked, ordinal_);  // throws: the process must restart
  if (queried != cudaSuccess && queried != cudaErrorNotReady) {
    (void)cudaGetLastError();  // not sticky: clear it
    throw invalid_argument("cuda_device::adopt_external_stream: " + hex(native) + " is not a live CUDA stream (" +
                           cudaGetErrorString(queried) + ")");
  }
  int device = -1;
  if (!capturing && cudaStreamGetDevice(s, &device) == cudaSuccess && device != ordinal_) {
    throw invalid_argument("cuda_device::adopt_external_stream: stream " + hex(native) + " belongs to CUDA device " +
                           std::to_string(device) + ", not " + cuda_label(ordinal_));
  }
  (void)cudaGetLastError();
  std::unique_lock lock(streams_mutex_);
  external_.insert(s);
  return stream_ref{native};
}

void cuda_streams::destroy_stream(stream_ref stream,
                                  const std::function<void(cudaStream_t)>& while_unregistering) {
  if (stream.is_default()) throw invalid_argument("cuda_device::destroy_stream: the default stream cannot be destroyed");
  const device_scope on_device(ordinal_);
  const auto native = static_cast<cudaStream_t>(stream.native);
  {
    std::unique_lock lock(streams_mutex_);
    if (streams_.erase(native) == 0) {
      throw invalid_argument("cuda_device::destroy_stream: stream " + hex(stream.native) + " is not a live stream of " +
                             cuda_label(ordinal_) + " (already destroyed, or made by another device)");
    }
    while_unregistering(native);
  }
  task_failures_->forget(native);
  check(cudaStreamDestroy(native), "cudaStreamDestroy");
}

void cuda_streams::synchronize(stream_ref stream) {
  const device_scope on_device(ordinal_);
  // The registry lock is not held while waiting, so waiting never blocks
  // creating or destroying other streams.
  const cudaStream_t native = lock_stream(stream, "synchronize").native;
  check_work(cudaStreamSynchronize(native), "cudaStreamSynchronize", ordinal_);
  if (auto failure = task_failures_->take(native)) throw stream_error("cuda_device::synchronize: " + *failure);
}

void cuda_streams::synchronize_device() {
  const device_scope on_device(ordinal_);
  check_work(cudaDeviceSynchronize(), "cudaDeviceSynchronize", ordinal_);
}

bool cuda_streams::query(stream_ref stream) {
  const device_scope on_device(ordinal_);
  const auto locked = lock_stream(stream, "query");
  const cudaError_t result = cudaStreamQuery(locked.native);
  if (result == cudaErrorNotReady) return false;
  check_work(result, "cudaStreamQuery", ordinal_);
  return true;
}

// ---- events -----------------------------------------------------------------------

cuda_streams::locked<cudaEvent_t> cuda_streams::lock_event(event_ref event, const char* op) const {
  std::shared_lock lock(events_mutex_);
  const auto native = static_cast<cudaEvent_t>(event.native);
  if (!events_.contains(native)) {
    throw invalid_argument(std::string("cuda_device::") + op + ": event " + hex(event.native) +
                           " is not a live event of " + cuda_label(ordinal_) +
                           " (destroyed, or made by another device)");
  }
  return {std::move(lock), native};
}

event_ref cuda_streams::create_event() {
  const device_scope on_device(ordinal_);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  std::unique_lock lock(events_mutex_);
  events_.insert(event);
  return event_ref{event};
}

void cuda_streams::destroy_event(event_ref event) {
  const device_scope on_device(ordinal_);
  const auto native = static_cast<cudaEvent_t>(event.native);
  {
    std::unique_lock lock(events_mutex_);
    if (events_.erase(native) == 0) {
      throw invalid_argument("cuda_device::destroy_event: event " + hex(event.native) + " is not a live event of " +
                             cuda_label(ordinal_) + " (already destroyed, or made by another device)");
    }
  }
  check(cudaEventDestroy(native), "cudaEventDestroy");
}

void cuda_streams::record(event_ref event, stream_ref stream) {
  const device_scope on_device(ordinal_);
  const auto s = lock_stream(stream, "record");
  const auto e = lock_event(event, "record");
  check(cudaEventRecord(e.native, s.native), "cudaEventRecord");
}

bool cuda_streams::query_event(event_ref event) {
  const device_scope on_device(ordinal_);
  const auto locked = lock_event(event, "query_event");
  const cudaError_t result = cudaEventQuery(locked.native);
  if (result == cudaErrorNotReady) return false;
  check_work(result, "cudaEventQuery", ordinal_);
  return true;
}

void cuda_streams::synchronize_event(event_ref event) {
  const device_scope on_device(ordinal_);
  const cudaEvent_t native = lock_event(event, "synchronize_event").native;  // not held while waiting
  check_work(cudaEventSynchronize(native), "cudaEventSynchronize", ordinal_);
}

void cuda_streams::wait(stream_ref stream, event_ref event) {
  const device_scope on_device(ordinal_);
  const auto s = lock_stream(stream, "wait");
  const auto e = lock_event(event, "wait");
  check(cudaStreamWaitEvent(s.native, e.native, 0), "cudaStreamWaitEvent");
}

// ---- work on a stream ---------------------------------------------------------------

void cuda_streams::copy(stream_ref stream, void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) {
    throw invalid_argument("cuda_device::copy: null " + std::string(dst == nullptr ? "dst" : "src") + " with " +
                           std::to_string(bytes) + " bytes to copy");
  }
  const device_scope on_device(ordinal_);
  const auto s = lock_stream(stream, "copy");
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.native), "cudaMemcpyAsync");
}

void cuda_streams::fill(stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr) {
    throw invalid_argument("cuda_device::fill: null dst with " + std::to_string(bytes) + " bytes to fill");
  }
  const device_scope on_device(ordinal_);
  const auto s = lock_stream(stream, "fill");
  check(cudaMemsetAsync(dst, value, bytes, s.native), "cudaMemsetAsync");
}

void cuda_streams::delay(stream_ref stream, std::chrono::microseconds duration) {
  const device_scope on_device(ordinal_);
  const auto s = lock_stream(stream, "delay");
  launch_spin(s.native, std::max(duration, std::chrono::microseconds::zero()));  // negative: no wait, as sleep_for
}

void cuda_streams::host_task(stream_ref stream, std::function<void()> task) {
  if (!task) throw invalid_argument("cuda_device::host_task: the task is empty");
  const device_scope on_device(ordinal_);
  const auto s = lock_stream(stream, "host_task");
  launch_host_task(s.native, std::move(task), task_failures_);
}

}  // namespace shoal::backend::detail
