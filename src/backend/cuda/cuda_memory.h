// The memory of one CUDA device as the CUDA backend hands it out: plain
// segments (cudaMalloc, shared by legacy CUDA IPC), growable ranges (VMM:
// cuMemAddressReserve ranges with cuMemCreate chunks mapped into them,
// chunks exportable as POSIX fds), and imports of memory other processes
// exported.
//
// Thread-safety: every member may be called from any thread at once. One
// mutex guards the records, taken last (no other lock is taken while it is
// held); map_chunks and unmap hold access_change_ shared for their whole
// call, grant_peer_access alone, so a grant meets every mapping whole:
// mapped, with its access set, and not being unmapped. Each call that
// reaches CUDA makes the device current first. The teardown_* members are
// the exception: they are for ~cuda_device only, when no call can run.
//
// Invariants (guarded by mutex_):
//   segments_ = live cudaMalloc segments, base -> bytes;
//   pinned_ = live cudaHostAlloc segments, base -> bytes;
//   reservations_ = live address ranges, base -> bytes;
//   mappings_ = chunks mapped in reservations, address -> bytes, each inside
//     exactly one reservation and disjoint from the others;
//   chunks_ = live chunk handles, handle -> bytes;
//   imports_ = open imports, returned pointer -> what to close;
//   peers_ = the other devices granted access to every mapping (each mapped
//     with access for this device and for every peer recorded when it was
//     claimed; a peer is recorded only once every mapping has its access).
// A record is removed before its resource is released, so two threads never
// release one thing; if the release then fails, the error is thrown and the
// record stays removed.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "shoal/backend/shareable_handle.h"
#include "shoal/backend/types.h"

namespace shoal::backend::detail {

struct cuda_driver;

class cuda_memory {
 public:
  /// The granularity() reported where the device has no growable ranges.
  static constexpr std::size_t granularity_without_vmm = std::size_t{2} << 20;

  /// Asks the driver whether device `ordinal`, which the calling thread has
  /// made current, has virtual memory management and POSIX-fd handles
  /// (growable()), and, where it has VMM, for its chunk granularity.
  explicit cuda_memory(int ordinal);
  cuda_memory(const cuda_memory&) = delete;
  cuda_memory& operator=(const cuda_memory&) = delete;

  /// Without VMM, reserve_range and create_physical throw backend_error;
  /// without POSIX-fd handles, chunks are made unshareable and
  /// export_memory of a pointer in one throws backend_error.
  [[nodiscard]] growable_support growable() const noexcept { return growable_; }
  [[nodiscard]] std::size_t granularity() const noexcept { return granularity_; }
  [[nodiscard]] memory_info info() const;

  void* allocate_segment(std::size_t bytes);
  void free_segment(void* base);

  /// Pinned host segments (see device::allocate_pinned_host).
  void* allocate_pinned_host(std::size_t bytes);
  void free_pinned_host(void* base);

  void* reserve_range(std::size_t bytes);
  void release_range(void* base);
  physical_ref create_physical(std::size_t bytes);
  void release_physical(physical_ref chunk);
  void map(void* address, physical_ref chunk);
  void map_chunks(void* address, std::span<const sized_chunk> chunks);
  void unmap(void* address);
  /// See device::grant_peer_access.
  void grant_peer_access(int peer);

  [[nodiscard]] shareable_handle export_memory(const void* ptr) const;
  /// Checks the handles, then imports one segment (cuda_ipc, read-write
  /// only) or maps several chunks back to back in one range (cuda_vmm_fd)
  /// with `access`.
  void* import_memory(std::span<const shareable_handle> chunks, memory_access access);
  void close_import(void* ptr);

  /// Teardown, errors ignored, in the order ~cuda_device gives: first every
  /// open import is closed, later everything else is released (mappings,
  /// chunks, reservations, segments). The records are left as they are.
  void teardown_imports(const cuda_driver& d) noexcept;
  void teardown_rest(const cuda_driver& d) noexcept;

 private:
  /// Checks that `c` may be mapped at `start` (a live chunk of the size it
  /// gives, inside one reservation, overlapping no mapping) and records the
  /// mapping; returns its size. Called with mutex_ held.
  std::size_t claim_mapping(std::uintptr_t start, const sized_chunk& c);
  struct import_record {
    handle_kind kind;
    std::uintptr_t base;  ///< what cudaIpcOpenMemHandle or cuMemAddressReserve returned
    std::size_t size;     ///< reserved bytes (cuda_vmm_fd only)
    std::vector<std::size_t> chunk_sizes;  ///< cuda_vmm_fd: chunks mapped back to back from base
  };

  [[nodiscard]] void* import_ipc(const shareable_handle& handle);
  [[nodiscard]] void* import_vmm(std::span<const shareable_handle> chunks, memory_access access);

  /// Throws backend_error naming `op` unless the device has growable ranges.
  void require_growable(const char* op) const;

  const int ordinal_;
  const growable_support growable_;  // asked of the driver once, in the constructor
  std::size_t granularity_ = 0;

  std::shared_mutex access_change_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> segments_;
  std::map<std::uintptr_t, std::size_t> pinned_;
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, std::size_t> mappings_;
  std::unordered_map<CUmemGenericAllocationHandle, std::size_t> chunks_;
  std::multimap<std::uintptr_t, import_record> imports_;
  std::vector<int> peers_;
};

}  // namespace shoal::backend::detail
