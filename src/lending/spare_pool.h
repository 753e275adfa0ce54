// The lender's spare chunks: memory given back (or reclaimed) kept for a
// later region of the same size, with the lender's mapping and exported
// handle, so lending it again costs no create, map or export.
//
// Trust rule (lender_config::reuse == same_uid): a borrower may keep a
// mapping after it gives a region back, so a chunk is lent again only to a
// borrower of the uid every earlier borrower of it had (take() matches the
// uid exactly); memory a shared region used (holders of several uids) never
// comes here.
//
// Invariants, next to the data:
//   bytes_ = sum of c.chunk.memory->size() over chunks_;
//   chunks_ is oldest first (put appends), so take_oldest releases in age order;
//   a serial appears at most once in a chunk's keepers.
//
// Not thread-safe: the lender guards it with its mutex.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <vector>

#include "lending/lendable_memory.h"

namespace shoal::lending::detail {

/// A chunk and the connections (by serial) that keep it mapped although it
/// is not lent to them now.
struct chunk_record {
  std::unique_ptr<lendable_memory> memory;
  std::vector<std::uint64_t> keepers;

  [[nodiscard]] bool kept_by(std::uint64_t serial) const noexcept;
  /// Removes `serial` from the keepers; whether it was one.
  bool drop_keeper(std::uint64_t serial) noexcept;
};

struct spare_chunk {
  chunk_record chunk;
  uid_t uid = 0;  ///< the uid of every borrower it was lent to
  std::chrono::steady_clock::time_point since;
};

class spare_pool {
 public:
  /// Keeps `chunk` as the newest spare. When memory runs out (bad_alloc)
  /// neither `chunk` nor the pool has changed.
  void put(chunk_record&& chunk, uid_t uid, std::chrono::steady_clock::time_point now);
  /// A spare of exactly `bytes` for a borrower of `uid`, one that connection
  /// `serial` keeps mapped when there is one, else the oldest that fits;
  /// nullopt when none does.
  [[nodiscard]] std::optional<spare_chunk> take(std::size_t bytes, uid_t uid, std::uint64_t serial);
  /// The spare take() would return, left in the pool; nullptr when none fits.
  [[nodiscard]] const spare_chunk* find(std::size_t bytes, uid_t uid, std::uint64_t serial) const noexcept;
  /// The oldest spare (to release it); nullopt when there is none.
  [[nodiscard]] std::optional<spare_chunk> take_oldest();
  /// Connection `serial` keeps nothing mapped any more (it hung up).
  void drop_keeper(std::uint64_t serial) noexcept;
  /// Calls visit(spare, keepers) for each spare, oldest first, until it
  /// returns false: a caller may change who keeps a spare mapped, nothing else.
  template <class Visit>
  void visit_keepers(Visit&& visit) {
    for (auto& s : chunks_) {
      if (!visit(static_cast<const spare_chunk&>(s), s.chunk.keepers)) return;
    }
  }
  /// Releases every spare (the lender is going).
  void clear() noexcept;

  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] const std::list<spare_chunk>& chunks() const noexcept { return chunks_; }

 private:
  spare_chunk remove(std::list<spare_chunk>::iterator it);

  std::list<spare_chunk> chunks_;
  std::size_t bytes_ = 0;
};

}  // namespace shoal::lending::detail
