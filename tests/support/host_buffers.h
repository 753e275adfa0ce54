// Host buffers for the transfer engine's tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "shoal/transfer/transfer_engine.h"

namespace shoal::testing {

/// A pageable host buffer of `bytes` bytes, each `value`, that the engine holds.
inline transfer::host_buffer pageable(std::size_t bytes, std::uint8_t value) {
  auto data = std::make_shared<std::vector<std::uint8_t>>(bytes, value);
  return transfer::host_buffer{data->data(), bytes, false, data};
}

}  // namespace shoal::testing
