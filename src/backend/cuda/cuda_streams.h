// The streams and events of one CUDA device, and the work enqueued on them
// (copy, fill, delay, host tasks).
//
// Streams are non-blocking CUDA streams (cudaStreamNonBlocking); the null
// stream_ref is the legacy default stream. Events have timing disabled.
// Every use looks the stream or event up in its registry, so a destroyed or
// foreign one gives shoal::invalid_argument rather than undefined behaviour.
//
// Thread-safety: every member may be called from any thread at once; each
// call makes the device current first. Destroying a stream or event while
// another thread still uses it is the caller's race, as on CUDA itself.
// teardown() is for ~cuda_device only, when no call can run.
//
// Invariants: external_ = streams of other libraries adopted for use (never
// destroyed here); streams_ = live streams made by this device (guarded by
// streams_mutex_); events_ = live events made by this device (guarded by
// events_mutex_). A record is removed before its stream or event is
// destroyed, so two threads never destroy one; if the destroy then fails,
// the error is thrown and the record stays removed. A call that uses a
// stream or event holds its registry's lock shared for the call (locked<>),
// except while waiting in synchronize and synchronize_event.
// Lock order: see cuda_device.h (streams_mutex_ before events_mutex_).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <unordered_set>

#include "backend/cuda/cuda_host_tasks.h"
#include "shoal/backend/types.h"

namespace shoal::backend::detail {

class cuda_streams {
 public:
  /// A live stream or event, kept from being destroyed while `lock` is held.
  template <class Native>
  struct locked {
    std::shared_lock<std::shared_mutex> lock;
    Native native;
  };

  explicit cuda_streams(int ordinal);
  cuda_streams(const cuda_streams&) = delete;
  cuda_streams& operator=(const cuda_streams&) = delete;

  /// `stream`, held live; or shoal::invalid_argument naming
  /// "cuda_device::<op>". The caller has made the device current.
  [[nodiscard]] locked<cudaStream_t> lock_stream(stream_ref stream, const char* op) const;

  stream_ref create_stream();
  stream_ref adopt_external_stream(void* native);
  /// `while_unregistering` runs while streams_mutex_ is held exclusively,
  /// after the stream left the registry and before it is destroyed.
  void destroy_stream(stream_ref stream, const std::function<void(cudaStream_t)>& while_unregistering);
  void synchronize(stream_ref stream);
  /// cudaDeviceSynchronize: every stream of the device, known here or not.
  void synchronize_device();
  [[nodiscard]] bool query(stream_ref stream);

  event_ref create_event();
  void destroy_event(event_ref event);
  void record(event_ref event, stream_ref stream);
  [[nodiscard]] bool query_event(event_ref event);
  void synchronize_event(event_ref event);
  void wait(stream_ref stream, event_ref event);

  void copy(stream_ref stream, void* dst, const void* src, std::size_t bytes);
  void fill(stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes);
  void delay(stream_ref stream, std::chrono::microseconds duration);
  void host_task(stream_ref stream, std::function<void()> task);

  /// Destroys every stream, then every event, errors ignored. The records
  /// are left as they are.
  void teardown() noexcept;

 private:
  [[nodiscard]] locked<cudaEvent_t> lock_event(event_ref event, const char* op) const;

  const int ordinal_;
  mutable std::shared_mutex streams_mutex_;
  std::unordered_set<cudaStream_t> streams_;
  std::unordered_set<cudaStream_t> external_;  // adopted, never destroyed here; guarded by streams_mutex_
  mutable std::shared_mutex events_mutex_;
  std::unordered_set<cudaEvent_t> events_;
  // Shared with pending host-task callbacks, which may run after the device
  // is gone.
  std::shared_ptr<cuda_task_failures> task_failures_;
};

}  // namespace shoal::backend::detail
