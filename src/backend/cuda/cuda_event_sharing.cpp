#include "backend/cuda/cuda_event_sharing.h"

#include <cstring>
#include <string>

#include "backend/cuda/cuda_current_device.h"
#include "backend/cuda/cuda_driver.h"
#include "core/address_text.h"
#include "core/process_wide_id.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {
using shoal::detail::hex;
}  // namespace

std::uint64_t cuda_event_sharing::create_exported_event() {
  static_assert(sizeof(cudaIpcEventHandle_t) == event_source::opaque_bytes);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
        "cudaEventCreateWithFlags(cudaEventInterprocess)");
  cudaIpcEventHandle_t handle{};
  const cudaError_t got = cudaIpcGetEventHandle(&handle, event);
  if (got != cudaSuccess) cudaEventDestroy(event);
  check(got, "cudaIpcGetEventHandle");
  const std::uint64_t id = shoal::detail::next_process_wide_id();
  try {
    exported_events_.emplace(id, exported_event{event, handle});
  } catch (...) {
    cudaEventDestroy(event);
    throw;
  }
  return id;
}

event_point cuda_event_sharing::export_event(cudaStream_t stream) {
  std::lock_guard lock(exported_events_mutex_);
  auto source = stream_sources_.find(stream);
  if (source == stream_sources_.end()) source = stream_sources_.emplace(stream, create_exported_event()).first;
  check(cudaEventRecord(exported_events_.at(source->second).event, stream), "cudaEventRecord(interprocess event)");
  return event_point{source->second, 0, 0};
}

event_source cuda_event_sharing::describe_event_source(std::uint64_t source_id) {
  std::lock_guard lock(exported_events_mutex_);
  const auto it = exported_events_.find(source_id);
  if (it == exported_events_.end()) {
    throw invalid_argument("cuda_device::describe_event_source: " + std::to_string(source_id) +
                           " is not an event source " + cuda_label(ordinal_) +
                           " exported (ids come from export_event)");
  }
  event_source source;
  source.kind = event_source_kind::cuda_ipc_event;
  source.device = device_kind::cuda;
  source.device_ordinal = ordinal_;
  source.source_id = source_id;
  std::memcpy(source.opaque.data(), &it->second.handle, sizeof it->second.handle);
  return source;
}

imported_event_ref cuda_event_sharing::open_event_source(const event_source& source) {
  if (source.kind != event_source_kind::cuda_ipc_event || source.device != device_kind::cuda) {
    throw invalid_argument("cuda_device::open_event_source: the source comes from a " +
                           std::string(to_string(source.device)) + " device; " + cuda_label(ordinal_) +
                           " opens CUDA IPC events only");
  }
  const device_scope on_device(ordinal_);
  cudaIpcEventHandle_t handle{};
  std::memcpy(&handle, source.opaque.data(), sizeof handle);
  cudaEvent_t event = nullptr;
  check(cudaIpcOpenEventHandle(&event, handle), "cudaIpcOpenEventHandle");
  try {
    std::unique_lock lock(imported_events_mutex_);
    imported_events_.emplace(event, source.source_id);
  } catch (...) {
    cudaEventDestroy(event);
    throw;
  }
  return imported_event_ref{event};
}

void cuda_event_sharing::wait_imported(cudaStream_t stream, imported_event_ref source, const event_point& point) {
  std::shared_lock lock(imported_events_mutex_);  // held so the event is not closed under the wait
  const auto it = imported_events_.find(static_cast<cudaEvent_t>(source.native));
  if (it == imported_events_.end()) {
    throw invalid_argument("cuda_device::wait_imported: " + hex(source.native) + " is not an event source open on " +
                           cuda_label(ordinal_) + " (closed already, or opened by another device)");
  }
  if (point.source_id != it->second) {
    throw invalid_argument("cuda_device::wait_imported: the point belongs to event source " +
                           std::to_string(point.source_id) + ", but the source given is " + std::to_string(it->second) +
                           "; open the point's own source and wait on that");
  }
  if (point.stream_slot != 0 || point.ticket != 0) {
    throw invalid_argument("cuda_device::wait_imported: the point has a stream slot or ticket, which only host "
                           "points have");
  }
  check(cudaStreamWaitEvent(stream, it->first, 0), "cudaStreamWaitEvent(imported event)");
}

void cuda_event_sharing::check_imported(imported_event_ref source) {
  std::shared_lock lock(imported_events_mutex_);
  if (!imported_events_.contains(static_cast<cudaEvent_t>(source.native))) {
    throw invalid_argument("cuda_device::event_source_exporter: " + hex(source.native) +
                           " is not an event source open on " + cuda_label(ordinal_) +
                           " (closed already, or opened by another device)");
  }
}

void cuda_event_sharing::close_event_source(imported_event_ref source) {
  const device_scope on_device(ordinal_);
  const auto event = static_cast<cudaEvent_t>(source.native);
  {
    std::unique_lock lock(imported_events_mutex_);
    if (imported_events_.erase(event) == 0) {
      throw invalid_argument("cuda_device::close_event_source: " + hex(source.native) +
                             " is not an event source open on " + cuda_label(ordinal_) + " (closed already?)");
    }
  }
  check(cudaEventDestroy(event), "cudaEventDestroy(imported event)");
}

void cuda_event_sharing::forget_stream(cudaStream_t stream) {
  // Its exported event stays (other processes may hold it) but is never
  // recorded again: a later stream at this address gets a new one.
  std::lock_guard exported_lock(exported_events_mutex_);
  stream_sources_.erase(stream);
}

void cuda_event_sharing::teardown() noexcept {
  for (const auto& [id, exported] : exported_events_) cudaEventDestroy(exported.event);
  for (const auto& [event, id] : imported_events_) cudaEventDestroy(event);
}

}  // namespace shoal::backend::detail
