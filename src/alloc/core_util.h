// Small helpers shared by the allocator's source files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/address_text.h"
#include "shoal/backend/types.h"

namespace shoal::alloc::detail {

using shoal::detail::hex;

/// On the small steps of the allocate/free fast path: inlined even where
/// the compiler would keep an externally visible member out of line.
#define SHOAL_HOT_INLINE [[gnu::always_inline]] inline

/// Debug mode fills freed memory with it, so a stale reader sees it.
inline constexpr std::uint8_t poison_byte = 0xDB;

/// no_host_waits_scope's depth on this thread: while positive, allocations
/// neither wait on the host nor give memory back (which waits for a stream).
inline thread_local int no_host_waits_depth = 0;
[[nodiscard]] inline bool host_waits_allowed() noexcept { return no_host_waits_depth == 0; }

inline void add_unique(std::vector<backend::stream_ref>& streams, backend::stream_ref s) {
  if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
}

}  // namespace shoal::alloc::detail
