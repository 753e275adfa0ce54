// The lender's prepared chunks (lender_config::prepared_chunks): memory made
// — created, mapped and exported — when the lender starts, so that the
// first region of a prepared size costs the lender nothing on the device
// and the borrower only its import and map.
//
// Trust rule: a prepared chunk has never been lent, so no borrower has it
// mapped: it may go to a borrower of any uid. Once lent it is an ordinary
// chunk: given back, it becomes a spare of its borrower's uid
// (spare_pool.h), or is released (reuse == never).
//
// Invariants, next to the data:
//   bytes_ = sum of c.memory->size() over chunks_;
//   every chunk here has no keepers (none was ever lent);
//   chunks_ is in the order the lender made them (oldest first).
//
// Not thread-safe: the lender guards it with its mutex.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "lending/spare_pool.h"

namespace shoal::lending::detail {

class prepared_chunks {
 public:
  /// Keeps `chunk`, made for this pool and never lent.
  void put(chunk_record chunk);
  /// The oldest chunk of exactly `bytes`, no longer kept here; nullopt
  /// when none is that size.
  [[nodiscard]] std::optional<chunk_record> take(std::size_t bytes);
  /// Chunks, oldest first, until they hold at least `bytes` or none is
  /// left (to release them); when memory runs out (bad_alloc) the pool
  /// has not changed.
  [[nodiscard]] std::vector<chunk_record> take_at_least(std::size_t bytes);

  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t count() const noexcept { return chunks_.size(); }

 private:
  std::vector<chunk_record> chunks_;
  std::size_t bytes_ = 0;
};

/// The sum of `sizes`, each rounded up to `granularity`; nullopt when a size
/// is 0 or the sum does not fit in a size_t.
[[nodiscard]] std::optional<std::size_t> prepared_total(const std::vector<std::size_t>& sizes,
                                                        std::size_t granularity) noexcept;

}  // namespace shoal::lending::detail
