#include "alloc/block_index.h"

namespace shoal::alloc::detail {

void block_index::grow() {
  std::vector<slot> old(slots_.size() * 2);  // may throw: nothing changed yet
  old.swap(slots_);
  mask_ = slots_.size() - 1;
  room_ = slots_.size() / 2;
  for (const slot& e : old) {
    if (e.address == 0) continue;
    std::size_t i = home(e.address);
    while (slots_[i].address != 0) i = (i + 1) & mask_;
    slots_[i] = e;
  }
}

void block_index::close_hole(std::size_t i) noexcept {
  const std::size_t mask = mask_;
  // Backward-shift deletion: pull later entries of the probe run into the
  // hole so lookups never stop early at it.
  std::size_t hole = i;
  for (std::size_t j = (i + 1) & mask; slots_[j].address != 0; j = (j + 1) & mask) {
    const std::size_t want = home(slots_[j].address);
    // j may move into the hole unless its home lies cyclically in (hole, j].
    const bool stays = hole <= j ? (hole < want && want <= j) : (hole < want || want <= j);
    if (!stays) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole] = {};
  --count_;
}

}  // namespace shoal::alloc::detail
