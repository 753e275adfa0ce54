#include "alloc/chunk_mapper.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

void bump(std::atomic<std::int64_t>& counter, std::int64_t by = 1) noexcept {
  counter.fetch_add(by, std::memory_order_relaxed);
}

}  // namespace

// creates and releases count chunks taken from the device and given back (a
// failed release too: its chunk is no longer held); maps, unmaps and access
// grants count the calls made, a failed one included, as each costs the
// driver's time either way.

backend::physical_ref chunk_mapper::create(std::size_t bytes) {
  const backend::physical_ref chunk = device_.create_physical(bytes);
  bump(creates_);
  held_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return chunk;
}

void chunk_mapper::release(const backend::sized_chunk& chunk) {
  // Counted as no longer held even when the release fails: no record of the
  // chunk is left to try again with.
  held_bytes_.fetch_sub(chunk.bytes, std::memory_order_relaxed);
  bump(releases_);
  device_.release_physical(chunk.chunk);
}

void chunk_mapper::release(spare_chunks& spare) { release_all(std::exchange(spare, {})); }

void chunk_mapper::release_all(std::span<const backend::sized_chunk> chunks) {
  std::exception_ptr first_failure;
  for (const backend::sized_chunk& c : chunks) {
    if (c.chunk.native == 0) continue;
    try {
      release(c);
    } catch (...) {  // the others still go back
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

bool chunk_mapper::map(segment& s, std::uintptr_t at, std::size_t bytes, spare_chunks& spare) {
  const std::size_t g = device_.granularity();
  // The range is cut as always (chunks of `most`, then the rest), so where
  // chunks lie, and thus what can be unmapped later, does not depend on the
  // spares; a spare of a piece's exact size serves it, the spares left over
  // go back to the device before any new chunk is made.
  const std::size_t most = round_up(s.gave_back ? growable_mapping_max : growable_ramp_mapping_max, g);
  std::vector<backend::sized_chunk> pieces;
  try {
    pieces.reserve(bytes / most + 1);  // no allocation between a create and its record
  } catch (...) {
    release_all_quietly(std::exchange(spare, {}));  // no room to record them: they go back
    throw;
  }
  for (std::size_t left = bytes; left > 0; left -= pieces.back().bytes) {
    const std::size_t piece = std::min(left, most);
    const auto same = std::ranges::find(spare, piece, &backend::sized_chunk::bytes);
    if (same != spare.end()) {
      pieces.push_back(*same);
      spare.erase(same);
    } else {
      pieces.push_back({backend::physical_ref{}, piece});
    }
  }
  try {
    release(spare);
    for (backend::sized_chunk& p : pieces) {
      if (p.chunk.native == 0) p.chunk = create(p.bytes);
    }
    // All pieces in one call: one access grant for the whole range.
    bump(maps_, static_cast<std::int64_t>(pieces.size()));
    bump(access_grants_);
    device_.map_chunks(reinterpret_cast<void*>(at), pieces);
  } catch (const out_of_memory&) {
    release_all_quietly(pieces);
    return false;
  } catch (...) {
    release_all_quietly(pieces);  // the error that ended the growth is the one to report
    throw;
  }
  std::size_t slot = (at - s.base) / g;
  for (const backend::sized_chunk& p : pieces) {
    std::fill_n(s.chunks.begin() + static_cast<std::ptrdiff_t>(slot), p.bytes / g, p.chunk);
    s.mapping_slots[slot] = p.bytes / g;
    slot += p.bytes / g;
  }
  return true;
}

void chunk_mapper::unmap(segment& s, std::uintptr_t lo, std::uintptr_t hi, spare_chunks* keep) {
  const std::size_t g = device_.granularity();
  for (std::size_t i = (lo - s.base) / g; i < (hi - s.base) / g;) {
    i += s.mapping_slots[i] != 0 ? unmap_at(s, i, keep) : 1;
  }
}

void chunk_mapper::release_all_quietly(std::span<const backend::sized_chunk> chunks) noexcept {
  try {
    release_all(chunks);
  } catch (...) {  // NOLINT(bugprone-empty-catch): every chunk was tried; none is held on our side any more
  }
}

void chunk_mapper::unmap_for_teardown(segment& s) noexcept {
  const std::size_t g = device_.granularity();
  for (std::size_t i = 0; i < s.size / g;) {
    const std::size_t slots = s.mapping_slots[i];
    if (slots == 0) {
      ++i;
      continue;
    }
    try {
      unmap_at(s, i, nullptr);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the device may be gone; the other mappings still go
    }
    i += slots;
  }
}

std::uintptr_t chunk_mapper::first_mapped(const segment& s, std::uintptr_t lo, std::uintptr_t hi) const {
  const std::size_t g = device_.granularity();
  for (std::size_t i = (lo - s.base) / g; i < (hi - s.base) / g; ++i) {
    if (s.mapping_slots[i] != 0) return s.base + i * g;
  }
  return hi;
}

std::size_t chunk_mapper::unmap_at(segment& s, std::size_t i, spare_chunks* keep) {
  const std::size_t g = device_.granularity();
  const std::size_t slots = s.mapping_slots[i];
  const backend::sized_chunk chunk{s.chunks[i], slots * g};
  // The chunk is kept once unmapped: nothing may throw then. Room grows
  // geometrically (reserve(size + 1) would copy the vector at every unmap).
  if (keep != nullptr && keep->size() == keep->capacity()) keep->reserve(std::max<std::size_t>(8, 2 * keep->size()));
  bump(unmaps_);
  device_.unmap(reinterpret_cast<void*>(s.base + i * g));  // throws: the mapping stays recorded as it is
  s.gave_back = true;
  s.mapping_slots[i] = 0;
  std::fill_n(s.chunks.begin() + static_cast<std::ptrdiff_t>(i), slots, backend::physical_ref{});
  if (keep != nullptr) {
    keep->push_back(chunk);
  } else {
    release(chunk);
  }
  return slots;
}

vmm_call_counts chunk_mapper::counts() const noexcept {
  return {.creates = creates_.load(std::memory_order_relaxed),
          .releases = releases_.load(std::memory_order_relaxed),
          .maps = maps_.load(std::memory_order_relaxed),
          .unmaps = unmaps_.load(std::memory_order_relaxed),
          .access_grants = access_grants_.load(std::memory_order_relaxed)};
}

void chunk_mapper::reset_counts() noexcept {
  for (auto* c : {&creates_, &releases_, &maps_, &unmaps_, &access_grants_}) c->store(0, std::memory_order_relaxed);
}

}  // namespace shoal::alloc::detail
