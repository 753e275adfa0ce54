#include "alloc/block_index.h"

#include <mutex>

namespace shoal::alloc::detail {

namespace {
std::size_t home(std::uint64_t h, std::size_t capacity) noexcept { return (h >> 20) & (capacity - 1); }
}  // namespace

void block_index::grow(shard& s) {
  std::vector<slot> old(s.slots.size() * 2);
  old.swap(s.slots);
  const std::size_t mask = s.slots.size() - 1;
  for (const slot& e : old) {
    if (e.address == 0) continue;
    std::size_t i = home(hash(e.address), s.slots.size());
    while (s.slots[i].address != 0) i = (i + 1) & mask;
    s.slots[i] = e;
  }
}

void block_index::insert(block* b) {
  const std::uint64_t h = hash(b->address);
  shard& s = shard_of(h);
  std::lock_guard lock(s.lock);
  if ((s.count + 1) * 2 > s.slots.size()) grow(s);
  const std::size_t mask = s.slots.size() - 1;
  std::size_t i = home(h, s.slots.size());
  while (s.slots[i].address != 0) i = (i + 1) & mask;
  s.slots[i] = {b->address, b};
  ++s.count;
}

block* block_index::take(std::uintptr_t address) noexcept {
  const std::uint64_t h = hash(address);
  shard& s = shard_of(h);
  std::lock_guard lock(s.lock);
  const std::size_t mask = s.slots.size() - 1;
  std::size_t i = home(h, s.slots.size());
  while (s.slots[i].address != address) {
    if (s.slots[i].address == 0) return nullptr;
    i = (i + 1) & mask;
  }
  block* found = s.slots[i].value;
  // Backward-shift deletion: pull later entries of the probe run into the
  // hole so lookups never stop early at it.
  std::size_t hole = i;
  for (std::size_t j = (i + 1) & mask; s.slots[j].address != 0; j = (j + 1) & mask) {
    const std::size_t want = home(hash(s.slots[j].address), s.slots.size());
    // Move j into the hole unless its home lies cyclically in (hole, j].
    const bool stays = hole <= j ? (hole < want && want <= j) : (hole < want || want <= j);
    if (!stays) {
      s.slots[hole] = s.slots[j];
      hole = j;
    }
  }
  s.slots[hole] = {};
  --s.count;
  return found;
}

block* block_index::find(std::uintptr_t address) const noexcept {
  const std::uint64_t h = hash(address);
  shard& s = shard_of(h);
  std::lock_guard lock(s.lock);
  const std::size_t mask = s.slots.size() - 1;
  for (std::size_t i = home(h, s.slots.size()); s.slots[i].address != 0; i = (i + 1) & mask) {
    if (s.slots[i].address == address) return s.slots[i].value;
  }
  return nullptr;
}

}  // namespace shoal::alloc::detail
