// Small helpers shared by the allocator's source files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/address_text.h"
#include "shoal/backend/types.h"

namespace shoal::alloc::detail {

using shoal::detail::hex;

inline void add_unique(std::vector<backend::stream_ref>& streams, backend::stream_ref s) {
  if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
}

}  // namespace shoal::alloc::detail
