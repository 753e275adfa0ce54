// The borrower's kept mappings: read-write mappings of exclusive regions'
// memory it gave back, kept (when the lender recorded them) so that a later
// lend of the same memory needs no import or map — the lender sends no chunk
// frames and the borrower uses the mapping kept here.
//
// Invariants, next to the data:
//   bytes_ = sum of m.size over mappings_ <= bound_ (keep() refuses past it);
//   a memory id is here iff the lender recorded this connection as keeping
//   it (it answered the give_back with kept) and has not sent forget for it
//   nor lent it to this connection since (take() removes it then).
// A mapping is dropped only on the lender's word (forget) or with the cache,
// never on the borrower's own: so the lender's record and this cache agree
// without a message from borrower to lender, and a forget for memory not
// here is the lender's error.
//
// Not thread-safe: the borrower's link guards it with its mutex. The
// destructor unmaps what is left.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>

#include "shoal/backend/device.h"

namespace shoal::lending::detail {

class mapping_cache {
 public:
  struct mapping {
    void* data = nullptr;
    std::size_t size = 0;
  };

  /// Keeps at most `bound` bytes mapped (0: keeps nothing).
  mapping_cache(backend::device& device, std::size_t bound) : device_(device), bound_(bound) {}
  ~mapping_cache();
  mapping_cache(const mapping_cache&) = delete;
  mapping_cache& operator=(const mapping_cache&) = delete;

  /// Whether a mapping of `size` more bytes would fit the bound.
  [[nodiscard]] bool room_for(std::size_t size) const noexcept { return bytes_ + size <= bound_ && size <= bound_; }
  /// Keeps `data` (an import of `size` bytes) as the mapping of `memory`.
  /// Precondition: room_for(size), and `memory` is not kept already.
  void keep(std::uint64_t memory, mapping m);
  /// The kept mapping of `memory`, no longer kept here (it is a region's
  /// again); nullopt when none is kept.
  [[nodiscard]] std::optional<mapping> take(std::uint64_t memory);
  [[nodiscard]] bool contains(std::uint64_t memory) const { return mappings_.contains(memory); }
  /// Unmaps the kept mapping of `memory`; false when none is kept.
  bool forget(std::uint64_t memory) noexcept;
  /// Forgets every mapping without unmapping it: in a fork() child, where
  /// they are the parent's (and the device's calls are not the child's).
  void abandon() noexcept {
    mappings_.clear();
    bytes_ = 0;
  }

  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t count() const noexcept { return mappings_.size(); }

 private:
  backend::device& device_;
  std::size_t bound_;
  std::map<std::uint64_t, mapping> mappings_;
  std::size_t bytes_ = 0;
};

}  // namespace shoal::lending::detail
