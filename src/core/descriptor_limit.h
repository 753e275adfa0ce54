// The process's soft limit on open descriptors (often 1024), raised to its
// hard limit by what keeps a descriptor open per piece of memory: the host
// backend (a memfd per segment and chunk) and a lender (an exported handle
// per chunk it may lend again, on every backend). A process that reaches
// the soft limit cannot accept a connection, make a chunk, or read /proc.
//
// Thread-safety: may be called from any thread at once.
#pragma once

namespace shoal::detail {

/// Raises the soft RLIMIT_NOFILE to the hard one when it is lower; leaves
/// it as it is when the system refuses.
void raise_descriptor_limit() noexcept;

}  // namespace shoal::detail
