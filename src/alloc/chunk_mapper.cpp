#include "alloc/chunk_mapper.h"

#include <algorithm>
#include <utility>

#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

void bump(std::atomic<std::int64_t>& counter, std::int64_t by = 1) noexcept {
  counter.fetch_add(by, std::memory_order_relaxed);
}

}  // namespace

bool chunk_mapper::map(segment& s, std::uintptr_t at, std::size_t bytes) {
  const std::size_t g = device_.granularity();
  std::uintptr_t a = at;
  try {
    while (a < at + bytes) {
      const std::size_t piece = std::min(at + bytes - a, round_up(growable_mapping_max, g));
      const backend::physical_ref chunk = device_.create_physical(piece);
      bump(creates_);
      try {
        device_.map(reinterpret_cast<void*>(a), chunk);
      } catch (...) {
        device_.release_physical(chunk);
        bump(releases_);
        throw;
      }
      bump(maps_);
      bump(access_grants_);  // map() sets the chunk's access itself
      const std::size_t first_slot = (a - s.base) / g;
      std::fill_n(s.chunks.begin() + static_cast<std::ptrdiff_t>(first_slot), piece / g, chunk);
      s.mapping_slots[first_slot] = piece / g;
      a += piece;
    }
  } catch (const out_of_memory&) {
    for (std::uintptr_t b = at; b < a;) b += unmap_at(s, (b - s.base) / g) * g;
    return false;
  }
  return true;
}

void chunk_mapper::unmap(segment& s, std::uintptr_t lo, std::uintptr_t hi) {
  const std::size_t g = device_.granularity();
  for (std::size_t i = (lo - s.base) / g; i < (hi - s.base) / g;) {
    i += s.mapping_slots[i] != 0 ? unmap_at(s, i) : 1;
  }
}

std::size_t chunk_mapper::unmap_at(segment& s, std::size_t i) {
  const std::size_t slots = std::exchange(s.mapping_slots[i], 0);
  device_.unmap(reinterpret_cast<void*>(s.base + i * device_.granularity()));
  bump(unmaps_);
  device_.release_physical(s.chunks[i]);
  bump(releases_);
  std::fill_n(s.chunks.begin() + static_cast<std::ptrdiff_t>(i), slots, backend::physical_ref{});
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
