// Host memory behind the host backend: memfd segments, PROT_NONE
// reservations with memfd chunks mapped into them, and imports of memory
// other processes exported.
//
// Thread-safety: all members may be called from any thread (one mutex).
// Invariants: used_bytes() = sum of live segment sizes + sum of sizes of
// chunks that still have a handle or a mapping; used_bytes() <= capacity.
// Every memfd is sealed against shrinking, so an importer can never be
// handed a file that later shrinks under its mapping (SIGBUS).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>

#include "shoal/backend/shareable_handle.h"
#include "shoal/backend/types.h"
#include "shoal/core/unique_fd.h"

namespace shoal::backend::detail {

class host_memory {
 public:
  static constexpr std::size_t chunk_granularity = std::size_t{2} << 20;

  explicit host_memory(std::size_t capacity_bytes);
  ~host_memory();
  host_memory(const host_memory&) = delete;
  host_memory& operator=(const host_memory&) = delete;

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
  void unmap(void* address);

  [[nodiscard]] shareable_handle export_memory(const void* ptr) const;
  /// Maps the chunks back to back in one range with `access` (see
  /// device::import_memory).
  void* import_memory(std::span<const shareable_handle> chunks, memory_access access);
  void close_import(void* ptr);

 private:
  struct chunk;  // a memfd-backed physical chunk, shared by its handle and mappings
  struct segment {
    std::size_t size;
    unique_fd fd;
  };
  struct mapping {
    std::size_t size;
    std::shared_ptr<chunk> backing;
  };
  struct reservation {
    std::size_t size;
    std::map<std::uintptr_t, mapping> mappings;  // by address
  };
  struct import {
    void* base;        ///< of the whole range, all chunks
    std::size_t size;  ///< of the whole range
  };

  // Takes `bytes` from the capacity or throws out_of_memory naming `what`.
  void charge(std::size_t bytes, const char* what);
  // The reservation whose range holds [address, address + bytes), or nullptr.
  reservation* reservation_holding(std::uintptr_t address, std::size_t bytes);

  const std::size_t capacity_;
  mutable std::mutex mutex_;
  // Atomic, not under mutex_: a chunk gives its bytes back from its
  // destructor, which may run while mutex_ is held.
  std::shared_ptr<std::atomic<std::size_t>> used_;
  std::map<std::uintptr_t, segment> segments_;          // by base
  std::map<std::uintptr_t, std::size_t> pinned_;        // pinned host segments: base -> mapped bytes
  std::map<std::uintptr_t, reservation> reservations_;  // by base
  std::unordered_map<std::uint64_t, std::shared_ptr<chunk>> chunks_;  // live handles
  std::uint64_t next_chunk_id_ = 1;
  std::unordered_map<void*, import> imports_;  // by the pointer import_memory returned
};

}  // namespace shoal::backend::detail
