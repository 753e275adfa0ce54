#include "alloc/free_bins.h"

#include <algorithm>
#include <bit>

#include "alloc/core_util.h"

namespace shoal::alloc::detail {

std::size_t free_bins::bin_of(std::size_t size) noexcept {
  const std::size_t units = size >> 9;
  if (units < exact_bins) return units;
  const auto log = static_cast<std::size_t>(std::bit_width(units) - 1);  // >= 11
  const std::size_t sub = (units >> (log - 3)) & (sub_bins - 1);
  return exact_bins + (log - 11) * sub_bins + sub;
}

void free_bins::insert(block* b) noexcept {
  const std::size_t bin = bin_of(b->size);
  b->bin = static_cast<std::uint32_t>(bin);
  b->bin_prev = nullptr;
  b->bin_next = heads_[bin];
  if (b->bin_next != nullptr) b->bin_next->bin_prev = b;
  heads_[bin] = b;
  nonempty_[bin / 64] |= std::uint64_t{1} << (bin % 64);
  nonempty_words_ |= std::uint64_t{1} << (bin / 64);
}

void free_bins::remove(block* b) noexcept {
  const std::size_t bin = b->bin;
  if (b->bin_prev != nullptr) {
    b->bin_prev->bin_next = b->bin_next;
  } else {
    heads_[bin] = b->bin_next;
  }
  if (b->bin_next != nullptr) b->bin_next->bin_prev = b->bin_prev;
  b->bin_prev = b->bin_next = nullptr;
  if (heads_[bin] == nullptr) {
    nonempty_[bin / 64] &= ~(std::uint64_t{1} << (bin % 64));
    if (nonempty_[bin / 64] == 0) nonempty_words_ &= ~(std::uint64_t{1} << (bin / 64));
  }
}

std::size_t free_bins::next_nonempty(std::size_t from) const noexcept {
  if (from >= bins) return bins;
  std::size_t word = from / 64;
  const std::uint64_t here = nonempty_[word] & (~std::uint64_t{0} << (from % 64));
  if (here != 0) return word * 64 + static_cast<std::size_t>(std::countr_zero(here));
  if (word + 1 >= words) return bins;
  const std::uint64_t later = nonempty_words_ & (~std::uint64_t{0} << (word + 1));
  if (later == 0) return bins;
  word = static_cast<std::size_t>(std::countr_zero(later));
  return word * 64 + static_cast<std::size_t>(std::countr_zero(nonempty_[word]));
}

std::size_t free_bins::smallest_size_of(std::size_t bin) noexcept {
  if (bin < exact_bins) return bin << 9;
  const std::size_t log = 11 + (bin - exact_bins) / sub_bins;
  const std::size_t sub = (bin - exact_bins) % sub_bins;
  return ((sub_bins + sub) << (log - 3)) << 9;
}

block* free_bins::best_fit(std::size_t bytes) const noexcept {
  std::size_t bin = bin_of(bytes);
  // The request's own bin may hold blocks smaller than it (above 1 MiB);
  // any later bin holds only larger ones. The first block of the smallest
  // fitting size in list order wins; a block of the least size the bin and
  // the request allow ends the walk, since no later one can beat it (a bin
  // of whole idle segments, all the same size, costs one step, not one per
  // segment).
  for (bin = next_nonempty(bin); bin < bins; bin = next_nonempty(bin + 1)) {
    const std::size_t least = std::max(bytes, smallest_size_of(bin));
    block* best = nullptr;
    for (block* b = heads_[bin]; b != nullptr; b = b->bin_next) {
      if (b->size >= bytes && (best == nullptr || b->size < best->size)) {
        best = b;
        if (b->size == least) break;
      }
    }
    if (best != nullptr) return best;
  }
  return nullptr;
}

std::size_t free_bins::largest() const noexcept {
  for (std::size_t w = words; w-- > 0;) {
    if (nonempty_[w] == 0) continue;
    const std::size_t bin = w * 64 + 63 - static_cast<std::size_t>(std::countl_zero(nonempty_[w]));
    std::size_t best = 0;
    for (block* b = heads_[bin]; b != nullptr; b = b->bin_next) best = b->size > best ? b->size : best;
    return best;
  }
  return 0;
}

bool free_bins::empty() const noexcept { return nonempty_words_ == 0; }

std::string free_bins::inconsistency() const {
  for (std::size_t bin = 0; bin < bins; ++bin) {
    const bool marked = ((nonempty_[bin / 64] >> (bin % 64)) & 1) != 0;
    if (marked != (heads_[bin] != nullptr)) {
      return "free bin " + std::to_string(bin) + (marked ? " is marked non-empty but holds no block" : " holds blocks but is marked empty");
    }
    const block* prev = nullptr;
    for (const block* b = heads_[bin]; b != nullptr; prev = b, b = b->bin_next) {
      if (b->bin_prev != prev) return "block " + hex(b->address) + " in free bin " + std::to_string(bin) + " has a broken back link";
      if (b->bin != bin || bin_of(b->size) != bin) {
        return "block " + hex(b->address) + " of " + std::to_string(b->size) + " bytes is in free bin " + std::to_string(bin) +
               " (it records bin " + std::to_string(b->bin) + "; its size belongs in bin " + std::to_string(bin_of(b->size)) + ")";
      }
    }
  }
  for (std::size_t w = 0; w < words; ++w) {
    if (((nonempty_words_ >> w) & 1) != (nonempty_[w] != 0 ? 1u : 0u)) {
      return "the summary bit of free-bin word " + std::to_string(w) + " disagrees with the word";
    }
  }
  return {};
}

}  // namespace shoal::alloc::detail
