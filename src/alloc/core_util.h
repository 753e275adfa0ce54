// Small helpers shared by the allocator's source files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "shoal/backend/types.h"

namespace shoal::alloc::detail {

/// An address as "0x..." for error messages.
inline std::string hex(std::uintptr_t v) {
  std::ostringstream out;
  out << "0x" << std::hex << v;
  return out.str();
}

inline void add_unique(std::vector<backend::stream_ref>& streams, backend::stream_ref s) {
  if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
}

}  // namespace shoal::alloc::detail
