// The CUDA backend: the device contract on one CUDA GPU.
//
// Plain segments are cudaMalloc allocations (shared by legacy CUDA IPC);
// growable ranges use the driver's virtual memory management (cuMemCreate
// chunks exportable as POSIX fds, mapped into cuMemAddressReserve ranges),
// where the device has it: growable() says so, from the two device
// attributes read once at construction.
// Streams are non-blocking CUDA streams; the default stream is the legacy
// default stream. Events have timing disabled. Each stream that exports a
// point gets one interprocess event, created on its first export_event and
// re-recorded by every later one.
//
// The device is three parts, each with its own header and locks, and the
// device's lifetime around them:
//   memory_  (cuda_memory.h): segments, reservations, chunks, mappings,
//            export_memory / import_memory / close_import;
//   streams_ (cuda_streams.h): streams, events, work on a stream, host tasks;
//   sharing_ (cuda_event_sharing.h): interprocess events, exported and
//            imported.
// cuda_device.cpp: construction, teardown, device discovery;
// cuda_device_calls.cpp: each device call handed to the part that owns it.
//
// Thread-safety: every member may be called from any thread at once; each
// call makes the device current on the calling thread first. Destroying a
// stream or event while another thread still uses it is the caller's race,
// as on CUDA itself; using one after destroy_* returned gives
// shoal::invalid_argument.
//
// Invariants: each part keeps its records, each guarded by its mutex (see
// the part's header). A record is removed before its resource is released,
// so two threads never release one thing; if the release then fails, the
// error is thrown and the record stays removed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "backend/cuda/cuda_event_sharing.h"
#include "backend/cuda/cuda_memory.h"
#include "backend/cuda/cuda_streams.h"
#include "shoal/backend/device.h"

namespace shoal::backend::detail {

class cuda_device final : public device {
 public:
  /// Opens CUDA device `ordinal`, which must exist (see make_cuda_device).
  explicit cuda_device(int ordinal);
  /// Releases everything still registered, ignoring errors (the runtime may
  /// already be shutting down).
  ~cuda_device() override;

  [[nodiscard]] device_kind kind() const noexcept override { return device_kind::cuda; }
  [[nodiscard]] int ordinal() const noexcept override { return ordinal_; }
  [[nodiscard]] std::string name() const override { return name_; }

  [[nodiscard]] memory_info memory() const override;
  void* allocate_segment(std::size_t bytes) override;
  void free_segment(void* base) override;
  void* allocate_pinned_host(std::size_t bytes) override;
  void free_pinned_host(void* base) override;

  [[nodiscard]] growable_support growable() const noexcept override { return memory_.growable(); }
  [[nodiscard]] std::size_t granularity() const noexcept override { return memory_.granularity(); }
  void* reserve_range(std::size_t bytes) override;
  void release_range(void* base) override;
  physical_ref create_physical(std::size_t bytes) override;
  void release_physical(physical_ref chunk) override;
  void map(void* address, physical_ref chunk) override;
  void map_chunks(void* address, std::span<const sized_chunk> chunks) override;
  void unmap(void* address) override;
  void grant_peer_access(int peer) override;

  stream_ref create_stream() override;
  stream_ref adopt_external_stream(void* native) override;
  void synchronize(stream_ref stream) override;
  void synchronize_device() override;
  [[nodiscard]] bool query(stream_ref stream) override;

  event_ref create_event() override;
  void destroy_event(event_ref event) override;
  void record(event_ref event, stream_ref stream) override;
  [[nodiscard]] bool query_event(event_ref event) override;
  void synchronize_event(event_ref event) override;
  void wait(stream_ref stream, event_ref event) override;

  void copy(stream_ref stream, void* dst, const void* src, std::size_t bytes) override;
  void fill(stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) override;
  void delay(stream_ref stream, std::chrono::microseconds duration) override;
  void host_task(stream_ref stream, std::function<void()> task) override;

  [[nodiscard]] shareable_handle export_memory(const void* ptr) override;
  using device::import_memory;
  void* import_memory(std::span<const shareable_handle> chunks, memory_access access) override;
  void close_import(void* ptr) override;

  [[nodiscard]] event_point export_event(stream_ref stream) override;
  [[nodiscard]] event_source describe_event_source(std::uint64_t source_id) override;
  imported_event_ref open_event_source(const event_source& source) override;
  [[nodiscard]] std::optional<process_identity> event_source_exporter(imported_event_ref source) override;
  void wait_imported(stream_ref stream, imported_event_ref source, const event_point& point) override;
  void close_event_source(imported_event_ref source) override;

 protected:
  void destroy_stream_now(stream_ref stream) override;

 private:
  // Declared in construction order: the streams' failure record is made
  // first, then the device is made current and named, then the memory asks
  // for its granularity.
  const int ordinal_;
  cuda_streams streams_;
  std::string name_;
  cuda_memory memory_;
  cuda_event_sharing sharing_;

  // Lock order, for every lock of the parts: streams_'s stream registry lock
  // comes before streams_'s event registry lock (record, wait) and before
  // both of sharing_'s locks (destroy_stream, export_event, wait_imported).
  // memory_'s mapping lock (access_change_) comes before memory_'s records
  // lock. Every other lock (memory_'s records, sharing_'s two, the host-task
  // failure record's) is taken alone: nothing else is locked while it is held.
};

/// Number of CUDA devices; 0 when there is no driver or no GPU.
[[nodiscard]] int cuda_device_count_impl() noexcept;
/// Why no CUDA device is usable, or "" when one is.
[[nodiscard]] std::string cuda_unavailable_reason_impl();
/// A new device object for `ordinal`. Throws shoal::device_unavailable
/// ("no CUDA device: <reason>") when there is no such device.
[[nodiscard]] std::unique_ptr<device> make_cuda_device(int ordinal);

}  // namespace shoal::backend::detail
