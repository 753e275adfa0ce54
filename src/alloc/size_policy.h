// How request sizes become block sizes, pools and segment sizes.
//
//   block size   = max(512, round up to 512), or to one of N divisions of
//                  its power-of-two interval when roundup_power2_divisions
//                  sets N > 1 there;
//   pool         = small for blocks <= 1 MiB, else large;
//   segment size = 2 MiB (small), 20 MiB (large blocks < 10 MiB), else the
//                  block rounded up to 2 MiB; blocks of max_split_size or
//                  more are never split, so they get a segment of their own
//                  size (rounded up to 2 MiB) instead of wasting a 20 MiB one;
//   fallback       = the block rounded up to 2 MiB: the segment taken when
//                  the limit or the device refuses the one above (a 6 MiB
//                  block fits in 8 MiB where 20 MiB would pass the limit).
//   fits         = block >= request, and, for blocks of max_split_size or
//                  more (never split), waste <= 1 MiB for requests below
//                  max_split_size, waste < max_non_split_rounding above;
//   can split    = rest >= 512, except that in plain segments of the
//                  large pool requests of max_split_size or more are never
//                  split. In growable segments a rest splits off whatever
//                  max_split_size says (kept, it would be held with its
//                  block: growth joined to a free neighbour would hand an
//                  oversize request the whole merged block). A rest of the
//                  large pool under 1 MiB serves no request there, but split
//                  off it joins its neighbours' frees, and the block counts
//                  as allocated what was asked plus rounding, whichever free
//                  block best fit chose (kept, up to 1 MiB more each).
#pragma once

#include <bit>
#include <cstddef>

#include "shoal/alloc/config.h"
#include "shoal/alloc/stats.h"

namespace shoal::alloc::detail {

inline constexpr std::size_t min_block = 512;
inline constexpr std::size_t small_limit = std::size_t{1} << 20;
inline constexpr std::size_t small_segment = allocator_config::smallest_reservation;
inline constexpr std::size_t large_segment = std::size_t{20} << 20;
inline constexpr std::size_t large_segment_limit = std::size_t{10} << 20;
inline constexpr std::size_t large_rounding = std::size_t{2} << 20;
/// A growable segment's growth maps physical chunks of at most this size
/// (rounded up to the device's granularity): one device call per chunk,
/// and the unit in which free memory is unmapped again. Larger chunks cost
/// fewer calls but leave more free memory that cannot go back (measured on
/// replayed traces, 2 MiB to unlimited: docs/architecture.md).
inline constexpr std::size_t growable_mapping_max = std::size_t{24} << 20;
/// Until a growable segment first gives memory back (segment::gave_back),
/// its growths map chunks of up to this size instead: while memory only
/// comes in, no chunk's size decides what can go back, and each chunk costs
/// an access grant (37-75 µs on an H100 whatever its size). A ramp of
/// 24-100 MiB growths (ResNet-50 training) then maps 170 chunks, not 244;
/// the bound keeps what one live block can hold mapped later (a chunk goes
/// back whole) to 128 MiB (docs/architecture.md).
inline constexpr std::size_t growable_ramp_mapping_max = std::size_t{128} << 20;
/// Requests above this cannot be rounded without overflow: out of memory.
inline constexpr std::size_t max_request = std::size_t{1} << 60;

[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

[[nodiscard]] inline std::size_t block_size_for(std::size_t bytes, const allocator_config& config) {
  if (bytes <= min_block) return min_block;
  const auto interval = static_cast<std::size_t>(std::bit_width(bytes - 1) - 1);  // bytes in (2^i, 2^(i+1)]
  const std::size_t divisions = config.roundup_power2_divisions[interval];
  if (divisions > 1) {
    const std::size_t step = (std::size_t{1} << interval) / divisions;
    if (step >= min_block) return round_up(bytes, step);
  }
  return round_up(bytes, min_block);
}

[[nodiscard]] constexpr pool_kind pool_kind_for(std::size_t block_size) {
  return block_size <= small_limit ? pool_kind::small : pool_kind::large;
}

[[nodiscard]] constexpr std::size_t segment_size_for(std::size_t block_size, const allocator_config& config) {
  if (block_size <= small_limit) return small_segment;
  if (block_size < large_segment_limit && block_size < config.max_split_size) return large_segment;
  return round_up(block_size, large_rounding);
}

/// The smallest segment that holds the block: asked for when the limit or
/// the device refuses segment_size_for's. Equal to it for small blocks and
/// blocks that get a segment of their own size.
[[nodiscard]] constexpr std::size_t fallback_segment_size_for(std::size_t block_size) {
  return round_up(block_size, large_rounding);
}

/// Whether the pool's blocks of max_split_size or more are split like any
/// other: a private pool's (its memory is all it has), and every pool's with
/// expandable segments (growth maps what a block lacks, so none stays whole
/// for a large request to come).
[[nodiscard]] inline bool splits_oversize(pool_kind kind, bool is_private, const allocator_config& config) noexcept {
  return kind == pool_kind::small || is_private || config.expandable_segments;
}

/// Whether a free block of `block_size` may serve a request of `size` in a
/// pool that splits_oversize() says of. Where oversize blocks (>=
/// max_split_size) are never split, one serves a request only if little of
/// it goes unused: no more than a split would have left behind for requests
/// under max_split_size, no more than max_non_split_rounding for larger ones.
[[nodiscard]] inline bool fits(std::size_t block_size, std::size_t size, bool oversize_split,
                               const allocator_config& config) noexcept {
  if (block_size < size) return false;
  if (oversize_split || block_size < config.max_split_size) return true;
  const std::size_t waste = block_size - size;
  return size < config.max_split_size ? waste <= small_limit : waste < config.max_non_split_rounding;
}

/// Whether handing `size` bytes out of a block of `block_size` (>= size)
/// splits the rest off as a free block of its own.
[[nodiscard]] inline bool can_split(std::size_t block_size, std::size_t size, pool_kind kind, bool is_private,
                                    const allocator_config& config) noexcept {
  if (!splits_oversize(kind, is_private, config) && size >= config.max_split_size) return false;
  return block_size - size >= min_block;
}

}  // namespace shoal::alloc::detail
