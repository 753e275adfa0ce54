// A borrowed region inserted into a caching allocator as a private pool
// (the seed's insertSharedCache / clearSharedCache): ordinary allocations
// come from it inside a private_pool_scope, in named sub-pools (say,
// "parameters" and "computation"), and clearing is stream-ordered.
//
//   adopted_region region(allocator, borrower.borrow(12 << 30, "model A"),
//                         {{"parameters", 2 << 30}, {"computation", 10 << 30}});
//   { alloc::private_pool_scope scope(allocator, region.pool(), "parameters"); load(); }
//   ... the model runs; its turn ends ...
//   region.clear("computation");              // reuse the sub-pool for the next batch
//   borrower.give_back(region.release());     // the next model's turn
//
// clear and release first wait (on the host) for every pending free of the
// memory and for every stream that last used it to pass that use; a block
// still allocated is a typed error (invalid_argument) that names the
// sub-pool, its live blocks and bytes, and changes nothing — unless asked
// to force it (alloc::live_blocks::invalidate): then the whole device is
// synchronized and the blocks are taken back and reported, each leaving a
// tombstone in the sub-pool so that its owner's late free never frees a
// newer block at the same address (the late free removes the tombstone,
// also after release(); adopting the same memory again before it brings
// the tombstone back, see caching_allocator::destroy_private_pool).
// Blocks shared with another process (sent through shoal's IPC) are never
// taken: invalid_argument naming them, and nothing changes. A forced clear
// or release does not drain (the device-wide wait covers it), so a stream
// destroyed since it used the memory does not stand in its way.
//
// Thread-safety: one thread at a time per adopted_region; nobody may
// allocate from a sub-pool while it is cleared or the region released.
// Lifetime: the allocator must outlive the adopted_region. Destroying an
// adopted_region that still holds the region releases it; when blocks are
// still allocated it cannot, so the region stays mapped for the process's
// life (those blocks stay valid) rather than vanish under them.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/lending/borrower.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::lending {

class adopted_region {
 public:
  /// Inserts `region` into `allocator` split into `parts` (name, bytes),
  /// each a positive multiple of 512 (one sub-pool named "" spanning the
  /// region when empty). invalid_argument (and the region given back by
  /// its destructor) when the parts do not fit.
  adopted_region(alloc::caching_allocator& allocator, borrowed_region region,
                 const std::vector<std::pair<std::string, std::size_t>>& parts = {});
  ~adopted_region();
  adopted_region(const adopted_region&) = delete;
  adopted_region& operator=(const adopted_region&) = delete;

  [[nodiscard]] alloc::private_pool_id pool() const noexcept { return pool_; }
  [[nodiscard]] bool adopted() const noexcept { return region_.valid(); }
  [[nodiscard]] const borrowed_region& region() const noexcept { return region_; }

  /// Forgets every free block of sub-pool `part` once no stream still uses
  /// its memory, so it can be filled anew. With live_blocks::refuse,
  /// invalid_argument naming the live blocks when any is allocated; with
  /// invalidate, they are taken back too. Returns what was taken back.
  alloc::invalidated_blocks_report clear(const std::string& part = "",
                                         alloc::live_blocks live = alloc::live_blocks::refuse);
  /// Takes the region out of the allocator once no stream still uses it and
  /// hands it back to the caller (to give back, or to adopt again). With
  /// live_blocks::refuse, invalid_argument naming the live blocks when any
  /// is allocated (the region stays adopted then); with invalidate, they
  /// are taken back first (`invalidated`, when given, says which).
  [[nodiscard]] borrowed_region release(alloc::live_blocks live = alloc::live_blocks::refuse,
                                        alloc::invalidated_blocks_report* invalidated = nullptr);

 private:
  alloc::caching_allocator& allocator_;
  borrowed_region region_;
  alloc::private_pool_id pool_{};
};

}  // namespace shoal::lending

#pragma GCC visibility pop
