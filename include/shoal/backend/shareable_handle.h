// A description of device memory that another process can map.
//
// A shareable_handle is produced by device::export_memory in one process and
// consumed by device::import_memory in another. It travels as two parts: the
// bytes of serialize() and, for kinds that carry one, a file descriptor sent
// alongside (SCM_RIGHTS). deserialize() validates every field, so a malformed
// message from another process gives shoal::protocol_error (an
// invalid_argument) and nothing else.
//
// Not thread-safe (a value type); it owns its descriptor.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shoal/backend/types.h"
#include "shoal/core/unique_fd.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::backend {

enum class handle_kind : std::uint8_t {
  host_memfd = 1,    ///< host backend: a memfd, mapped with mmap
  cuda_ipc = 2,      ///< CUDA legacy IPC handle of a cudaMalloc segment
  cuda_vmm_fd = 3,   ///< CUDA VMM physical chunk exported as a POSIX fd
};

[[nodiscard]] constexpr bool carries_fd(handle_kind kind) noexcept {
  return kind != handle_kind::cuda_ipc;
}

struct shareable_handle {
  /// Bytes of the CUDA legacy IPC handle (cudaIpcMemHandle_t is 64 bytes).
  static constexpr std::size_t opaque_bytes = 64;
  /// Bytes serialize() produces.
  static constexpr std::size_t wire_bytes = 4 + 2 + 1 + 1 + 4 + 8 + 8 + opaque_bytes;

  handle_kind kind = handle_kind::host_memfd;
  device_kind device = device_kind::host;
  std::int32_t device_ordinal = 0;
  std::uint64_t size = 0;    ///< bytes of the exported segment or chunk
  std::uint64_t offset = 0;  ///< where the exported pointer lies in it; offset < size
  std::array<std::byte, opaque_bytes> opaque{};  ///< cuda_ipc only; zero otherwise
  unique_fd fd;  ///< valid iff carries_fd(kind)

  /// The same handle with a new descriptor for the same memory (dup).
  [[nodiscard]] shareable_handle duplicate() const;
  /// The fixed-size wire form of everything but the descriptor.
  [[nodiscard]] std::vector<std::byte> serialize() const;
  /// Rebuilds a handle from serialize()'s bytes and the descriptor received
  /// with them (-1 when none came). Throws shoal::protocol_error, saying
  /// which field is wrong, on any malformed input; `fd` is closed then.
  [[nodiscard]] static shareable_handle deserialize(std::span<const std::byte> bytes, unique_fd fd);
};

}  // namespace shoal::backend

#pragma GCC visibility pop
