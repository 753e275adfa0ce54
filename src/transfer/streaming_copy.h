// A copy whose stores bypass the cache (non-temporal stores). Staging blocks
// are written once by the CPU and then read by the copy engine, never by the
// CPU again: an ordinary copy reads each destination line into the cache
// before writing it (three bytes of memory traffic per byte copied), a
// streaming copy does not (two), which is what bounds staging pageable bytes.
//
// Thread-safety: none needed (no state). The stores are fenced before it
// returns, so whatever the caller does next (hand the block to the copy
// engine) sees every byte.
#pragma once

#include <cstddef>

namespace shoal::transfer {

/// Copies `bytes` from `src` to `dst` (not overlapping) with non-temporal
/// stores where the platform has them; plain memcpy elsewhere.
void copy_streaming(void* dst, const void* src, std::size_t bytes) noexcept;

}  // namespace shoal::transfer
