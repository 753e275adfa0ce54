// Ordering across processes on one CUDA device: the interprocess events its
// streams export (export_event, describe_event_source) and the events of
// other processes it opens and waits on (open_event_source, wait_imported,
// close_event_source).
//
// Each stream that exports a point gets one interprocess event
// (cudaEventInterprocess, timing disabled), created on its first export and
// re-recorded by every later one, so a wait covers that export or a later
// one on the stream. The stream itself is looked up and held live by the
// caller (cuda_streams::lock_stream), which passes the native stream in.
//
// Thread-safety: every member may be called from any thread at once.
// teardown() is for ~cuda_device only, when no call can run.
//
// Invariants:
//   exported_events_ = every interprocess event this device exported,
//     source id -> event, kept until the device is destroyed (other
//     processes may hold them); stream_sources_ = live streams that
//     exported, stream -> source id, so a stream's event is never reused by
//     a later stream at the same address (both guarded by
//     exported_events_mutex_);
//   imported_events_ = open imported sources, event -> source id (guarded
//     by imported_events_mutex_, held shared through a wait so the event is
//     not closed under it).
// A record is removed before its event is destroyed, so two threads never
// destroy one; if the destroy then fails, the error is thrown and the
// record stays removed.
// Lock order: see cuda_device.h (the stream registry's lock before either).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "shoal/backend/shareable_event.h"
#include "shoal/backend/types.h"

namespace shoal::backend::detail {

class cuda_event_sharing {
 public:
  explicit cuda_event_sharing(int ordinal) : ordinal_(ordinal) {}
  cuda_event_sharing(const cuda_event_sharing&) = delete;
  cuda_event_sharing& operator=(const cuda_event_sharing&) = delete;

  /// Records `stream`'s interprocess event (made on its first export) on it.
  /// `stream` is held live by the caller, who has made the device current.
  [[nodiscard]] event_point export_event(cudaStream_t stream);
  [[nodiscard]] event_source describe_event_source(std::uint64_t source_id);
  imported_event_ref open_event_source(const event_source& source);
  /// Orders later work on `stream` after `point` of `source`. `stream` is
  /// held live by the caller, who has made the device current.
  void wait_imported(cudaStream_t stream, imported_event_ref source, const event_point& point);
  void close_event_source(imported_event_ref source);
  /// Throws invalid_argument unless `source` is open here.
  void check_imported(imported_event_ref source);

  /// Called while `stream` is being destroyed (with the stream registry's
  /// lock held): its exported event stays, but is never recorded again.
  void forget_stream(cudaStream_t stream);

  /// Destroys every exported event, then every imported one, errors
  /// ignored. The records are left as they are.
  void teardown() noexcept;

 private:
  struct exported_event {
    cudaEvent_t event;             ///< interprocess, timing disabled; re-recorded by each export
    cudaIpcEventHandle_t handle;   ///< fetched once, at creation
  };

  /// A new exported event, registered under a new source id (returned).
  /// Requires exported_events_mutex_.
  [[nodiscard]] std::uint64_t create_exported_event();

  const int ordinal_;
  std::mutex exported_events_mutex_;
  std::unordered_map<std::uint64_t, exported_event> exported_events_;
  std::unordered_map<cudaStream_t, std::uint64_t> stream_sources_;
  std::shared_mutex imported_events_mutex_;
  std::unordered_map<cudaEvent_t, std::uint64_t> imported_events_;
};

}  // namespace shoal::backend::detail
