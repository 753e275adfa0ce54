// Shared memory that cannot change size under a mapping: an anonymous memfd,
// sized, then sealed against shrinking and growing (F_SEAL_SHRINK |
// F_SEAL_GROW | F_SEAL_SEAL), so a process that maps it may touch every byte
// without risk of SIGBUS whatever the other processes holding it do.
// Internal (not installed); used by the host backend's memory and event
// pages, the channel's rings and the ipc layer's counter files.
#pragma once

#include <cstddef>

#include "shoal/core/unique_fd.h"

namespace shoal::detail {

/// A memfd of `bytes` zero bytes that allows sealing, not sealed yet: for a
/// creator that maps it first, where a later seal (F_SEAL_FUTURE_WRITE)
/// forbids the writable mapping it needs. `name` shows in /proc/<pid>/fd
/// and in errors. Throws backend_error.
unique_fd make_unsealed_memfd(const char* name, std::size_t bytes);

/// Seals a make_unsealed_memfd descriptor against shrinking, growing, the
/// seals in `extra` and any seal after these. Throws backend_error.
void seal_memfd(int fd, const char* name, int extra = 0);

/// make_unsealed_memfd, then seal_memfd.
unique_fd make_sealed_memfd(const char* name, std::size_t bytes);

/// Whether `fd` is a file on tmpfs, where memfd_create makes them — checked
/// of a descriptor another process sent, besides its seals: a hugetlbfs
/// memfd (MFD_HUGETLB) also seals, but a page its sender punches out faults
/// in again only while huge pages are free, and SIGBUS otherwise.
[[nodiscard]] bool on_tmpfs(int fd) noexcept;

}  // namespace shoal::detail
