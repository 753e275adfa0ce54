// The CUDA backend: the device contract on one CUDA GPU.
//
// Plain segments are cudaMalloc allocations (shared by legacy CUDA IPC);
// growable ranges use the driver's virtual memory management (cuMemCreate
// chunks exportable as POSIX fds, mapped into cuMemAddressReserve ranges).
// Streams are non-blocking CUDA streams; the default stream is the legacy
// default stream. Events have timing disabled. Each stream that exports a
// point gets one interprocess event, created on its first export_event and
// re-recorded by every later one.
//
// Thread-safety: every member may be called from any thread at once; each
// call makes the device current on the calling thread first. Destroying a
// stream or event while another thread still uses it is the caller's race,
// as on CUDA itself; using one after destroy_* returned gives
// shoal::invalid_argument.
//
// Invariants (each record guarded by its mutex):
//   segments_ = live cudaMalloc segments, base -> bytes;
//   reservations_ = live address ranges, base -> bytes;
//   mappings_ = chunks mapped in reservations, address -> bytes, each inside
//     exactly one reservation and disjoint from the others;
//   chunks_ = live chunk handles, handle -> bytes;
//   imports_ = open imports, returned pointer -> what to close;
//   streams_, events_ = live objects made by this device;
//   exported_events_ = every interprocess event this device exported,
//     source id -> event, kept until the device is destroyed (other
//     processes may hold them); stream_sources_ = live streams that
//     exported, stream -> source id, so a stream's event is never reused by
//     a later stream at the same address;
//   imported_events_ = open imported sources, event -> source id.
// A record is removed before its resource is released, so two threads never
// release one thing; if the release then fails, the error is thrown and the
// record stays removed.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "shoal/backend/device.h"

namespace shoal::backend::detail {

struct cuda_task_failures;

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

  [[nodiscard]] std::size_t granularity() const noexcept override { return granularity_; }
  void* reserve_range(std::size_t bytes) override;
  void release_range(void* base) override;
  physical_ref create_physical(std::size_t bytes) override;
  void release_physical(physical_ref chunk) override;
  void map(void* address, physical_ref chunk) override;
  void unmap(void* address) override;

  stream_ref create_stream() override;
  void destroy_stream(stream_ref stream) override;
  void synchronize(stream_ref stream) override;
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
  void* import_memory(std::span<const shareable_handle> chunks) override;
  void close_import(void* ptr) override;

  [[nodiscard]] event_point export_event(stream_ref stream) override;
  [[nodiscard]] event_source describe_event_source(std::uint64_t source_id) override;
  imported_event_ref open_event_source(const event_source& source) override;
  void wait_imported(stream_ref stream, imported_event_ref source, const event_point& point) override;
  void close_event_source(imported_event_ref source) override;

 private:
  struct import_record {
    handle_kind kind;
    std::uintptr_t base;  ///< what cudaIpcOpenMemHandle or cuMemAddressReserve returned
    std::size_t size;     ///< reserved bytes (cuda_vmm_fd only)
    std::vector<std::size_t> chunk_sizes;  ///< cuda_vmm_fd: chunks mapped back to back from base
  };
  struct exported_event {
    cudaEvent_t event;             ///< interprocess, timing disabled; re-recorded by each export
    cudaIpcEventHandle_t handle;   ///< fetched once, at creation
  };
  /// A live stream or event, kept from being destroyed while `lock` is held.
  template <class Native>
  struct locked {
    std::shared_lock<std::shared_mutex> lock;
    Native native;
  };

  void make_current() const;
  [[nodiscard]] locked<cudaStream_t> lock_stream(stream_ref stream, const char* op) const;
  [[nodiscard]] locked<cudaEvent_t> lock_event(event_ref event, const char* op) const;
  [[nodiscard]] void* import_ipc(const shareable_handle& handle);
  [[nodiscard]] void* import_vmm(std::span<const shareable_handle> chunks);
  /// A new exported event, registered under a new source id (returned).
  /// Requires exported_events_mutex_.
  [[nodiscard]] std::uint64_t create_exported_event();

  const int ordinal_;
  std::string name_;
  std::size_t granularity_ = 0;

  mutable std::mutex memory_mutex_;
  std::map<std::uintptr_t, std::size_t> segments_;
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, std::size_t> mappings_;
  std::unordered_map<CUmemGenericAllocationHandle, std::size_t> chunks_;
  std::multimap<std::uintptr_t, import_record> imports_;

  // Lock order: streams_mutex_ before events_mutex_, and streams_mutex_
  // before exported_events_mutex_.
  mutable std::shared_mutex streams_mutex_;
  std::unordered_set<cudaStream_t> streams_;
  mutable std::shared_mutex events_mutex_;
  std::unordered_set<cudaEvent_t> events_;
  std::mutex exported_events_mutex_;
  std::unordered_map<std::uint64_t, exported_event> exported_events_;
  std::unordered_map<cudaStream_t, std::uint64_t> stream_sources_;
  std::shared_mutex imported_events_mutex_;
  std::unordered_map<cudaEvent_t, std::uint64_t> imported_events_;

  // Shared with pending host-task callbacks, which may run after the device
  // is gone.
  std::shared_ptr<cuda_task_failures> task_failures_;
};

/// Number of CUDA devices; 0 when there is no driver or no GPU.
[[nodiscard]] int cuda_device_count_impl() noexcept;
/// Why no CUDA device is usable, or "" when one is.
[[nodiscard]] std::string cuda_unavailable_reason_impl();
/// A new device object for `ordinal`. Throws shoal::device_unavailable
/// ("no CUDA device: <reason>") when there is no such device.
[[nodiscard]] std::unique_ptr<device> make_cuda_device(int ordinal);

}  // namespace shoal::backend::detail
