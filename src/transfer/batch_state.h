// What the engine's pieces share about one batch: its job as submitted, the
// transferred batch handed to the consumer, and a finished batch waiting to
// be taken.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "shoal/transfer/transfer_engine.h"

namespace shoal::transfer {

struct transferred_batch::state {
  std::uint64_t sequence = 0;
  std::vector<storage::storage> storages;
  backend::device* device = nullptr;
  /// Recorded once on the engine's stream after the last copy of the batch's
  /// group, shared by the batches of the group and with the sources held
  /// until the copies have run.
  std::shared_ptr<backend::event> ready;
};

/// Whether `more` bytes fit beside `used` within `bound`, with no sum that
/// could wrap around.
[[nodiscard]] constexpr bool fits_beside(std::size_t used, std::size_t more, std::size_t bound) noexcept {
  return used <= bound && more <= bound - used;
}

struct transfer_engine::job {
  std::uint64_t sequence = 0;
  std::vector<host_buffer> buffers;
  /// submit's tag: moved into the batch's outcome once the copier is done
  /// with the job, so that it travels with its batch to take().
  std::shared_ptr<const void> tag;

  /// At most PTRDIFF_MAX (submit checks), so the sum does not wrap.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const host_buffer& b : buffers) total += b.bytes;
    return total;
  }
};

/// Exactly one of `batch` and `error` is set.
struct transfer_engine::outcome {
  std::uint64_t sequence = 0;
  std::size_t bytes = 0;  ///< the job's, counted in flight until it is taken
  std::shared_ptr<const transferred_batch::state> batch;
  std::exception_ptr error;
  std::shared_ptr<const void> tag;  ///< the job's, whichever of batch and error is set
};

}  // namespace shoal::transfer
