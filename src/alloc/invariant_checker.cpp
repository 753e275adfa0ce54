#include "alloc/invariant_checker.h"

#include <algorithm>
#include <string>
#include <unordered_set>
#include <vector>

#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

[[noreturn]] void fail(const char* invariant, const std::string& what) {
  throw invariant_violation(invariant, std::string("caching_allocator invariant '") + invariant + "' broken: " + what +
                                           ". This is a bug in shoal (or memory overwritten from outside); please "
                                           "report it with the allocator's snapshot and trace");
}

const char* state_name(block_state s) {
  switch (s) {
    case block_state::allocated: return "allocated";
    case block_state::pending_free: return "pending_free";
    case block_state::free: return "free";
    case block_state::invalidated: return "invalidated";
  }
  return "?";
}

std::string pool_name(const block_pool& p) {
  if (p.is_private) return "private sub-pool '" + p.part_name + "'";
  return std::string(p.kind == pool_kind::small ? "small" : "large") + " pool of stream " + hex(p.stream.native);
}

std::string segment_name(const segment& s) {
  return "segment " + hex(s.base) + " (" + std::to_string(s.size) + " bytes)";
}

std::string block_name(const block* b) {
  return "block " + hex(b->address) + " (" + std::to_string(b->size) + " bytes, " + state_name(b->state) +
         (b->mapped ? "" : ", unmapped") + (b->quick ? ", parked" : "") + ")";
}

void check_tiling(const block_pool& pool, const segment& s, std::size_t granularity) {
  const std::string where = segment_name(s) + " of the " + pool_name(pool);
  if (s.pool != &pool) fail("tiling", where + " names another pool as its owner");
  if (s.first == nullptr) fail("tiling", where + " has no blocks");
  if (s.first->address != s.base || s.first->prev != nullptr) {
    fail("tiling", where + ": its first " + block_name(s.first) + " does not start at the segment's base");
  }
  std::size_t total = 0, mapped = 0;
  for (const block* b = s.first; b != nullptr; b = b->next) {
    if (b->owner != &s) fail("tiling", where + ": " + block_name(b) + " names another segment as its owner");
    if (b->size == 0 || b->size > s.size - total) {
      fail("tiling", where + ": " + block_name(b) + " reaches past the segment's end");
    }
    total += b->size;
    if (b->next != nullptr) {
      if (b->next->address != b->address + b->size) {
        fail("tiling", where + ": " + block_name(b) + " ends at " + hex(b->address + b->size) +
                           " but the next block starts at " + hex(b->next->address) +
                           (b->next->address < b->address + b->size ? " (overlap)" : " (gap)"));
      }
      if (b->next->prev != b) fail("tiling", where + ": " + block_name(b->next) + " does not link back to " + block_name(b));
    }
    if (b->mapped) {
      mapped += b->size;
    } else {
      if (!s.expandable) fail("tiling", where + ": " + block_name(b) + " is unmapped in a segment that is not growable");
      if (b->state != block_state::free) fail("tiling", where + ": unmapped " + block_name(b) + " is not free");
      if ((b->address - s.base) % granularity != 0 || b->size % granularity != 0) {
        fail("tiling", where + ": unmapped " + block_name(b) + " is not aligned to whole chunks");
      }
    }
    if (s.expandable) {
      // A chunk is mapped iff the block holding its start is.
      const std::size_t first_chunk = (b->address - s.base + granularity - 1) / granularity;
      for (std::size_t i = first_chunk; i < s.chunks.size() && s.base + i * granularity < b->address + b->size; ++i) {
        if ((s.chunks[i].native != 0) != b->mapped) {
          fail("tiling", where + ": chunk " + std::to_string(i) + " is " + (b->mapped ? "not " : "") + "mapped under " +
                             block_name(b));
        }
      }
    }
  }
  if (total != s.size) {
    fail("tiling", where + ": its blocks cover " + std::to_string(total) + " bytes, not the segment's size");
  }
  if (s.expandable) {
    // Each mapping's slots hold its one chunk; slots outside mappings hold none.
    for (std::size_t i = 0; i < s.chunks.size();) {
      const std::size_t slots = s.mapping_slots[i];
      for (std::size_t k = i + 1; k < i + slots; ++k) {
        if (k >= s.chunks.size() || s.mapping_slots[k] != 0 || s.chunks[k].native != s.chunks[i].native) {
          fail("tiling", where + ": the mapping at chunk " + std::to_string(i) + " does not hold its " +
                             std::to_string(slots) + " chunks whole");
        }
      }
      if (slots == 0 && s.chunks[i].native != 0) {
        fail("tiling", where + ": chunk " + std::to_string(i) + " is mapped outside any mapping");
      }
      i += slots == 0 ? 1 : slots;
    }
  }
  if (mapped != s.mapped_bytes) {
    fail("tiling", where + ": its mapped blocks hold " + std::to_string(mapped) + " bytes but mapped_bytes is " +
                       std::to_string(s.mapped_bytes));
  }
}

void check_counter(const block_pool& pool, const char* name, const stat& st, std::int64_t expected) {
  if (st.current != expected) {
    fail("counters", "the " + pool_name(pool) + " counts " + name + " = " + std::to_string(st.current) +
                         " but its blocks sum to " + std::to_string(expected));
  }
  if (st.current != st.allocated - st.freed || st.current > st.peak) {
    fail("counters", "the " + pool_name(pool) + "'s " + name + " stat breaks current = allocated - freed <= peak (" +
                         std::to_string(st.current) + ", " + std::to_string(st.allocated) + " - " +
                         std::to_string(st.freed) + ", peak " + std::to_string(st.peak) + ")");
  }
}

void check_pool(const block_pool& pool, std::size_t granularity) {
  // Out of service, its blocks could not be found by address.
  if (!pool.in_service) fail("directory", "the " + pool_name(pool) + " is in the directory but out of service");
  for (const auto& s : pool.segments) check_tiling(pool, *s, granularity);

  std::unordered_set<const block*> in_bins;
  pool.bins.for_each([&](const block* b) { in_bins.insert(b); });
  if (const std::string wrong = pool.bins.inconsistency(); !wrong.empty()) {
    fail("free bins", "the " + pool_name(pool) + "'s " + wrong);
  }
  std::unordered_set<const block*> pending(pool.pending.begin(), pool.pending.end());
  if (pending.size() != pool.pending.size()) fail("states", "the " + pool_name(pool) + "'s pending list holds a block twice");
  if (pool.quick_count > block_pool::quick_capacity) fail("free bins", "the " + pool_name(pool) + "'s quick list overflows");
  std::unordered_set<const block*> parked(pool.quick.begin(),
                                           pool.quick.begin() + static_cast<std::ptrdiff_t>(pool.quick_count));

  std::int64_t allocations = 0, allocated_bytes = 0, requested_bytes = 0, active = 0, active_bytes = 0;
  std::int64_t inactive_split = 0, inactive_split_bytes = 0, reserved = 0, invalidated = 0, invalidated_bytes = 0;
  std::size_t settled = 0, pending_found = 0, parked_found = 0;
  for (const auto& s : pool.segments) {
    const std::string where = " in " + segment_name(*s) + " of the " + pool_name(pool);
    reserved += static_cast<std::int64_t>(s->mapped_bytes);
    for (const block* b = s->first; b != nullptr; b = b->next) {
      const auto size = static_cast<std::int64_t>(b->size);
      // free bins and the quick list
      if (settled_free(b) != in_bins.contains(b)) {
        fail("free bins", block_name(b) + where + (in_bins.contains(b) ? " is in the free bins but is not settled free"
                                                                      : " is settled free but not in the free bins"));
      }
      settled += settled_free(b) ? 1 : 0;
      if (b->quick != parked.contains(b)) {
        fail("free bins", block_name(b) + where + (b->quick ? " is marked parked but is not in the quick list"
                                                            : " is in the quick list but not marked parked"));
      }
      if (b->quick && (b->state != block_state::free || !b->mapped)) {
        fail("free bins", block_name(b) + where + " is parked but not free and mapped");
      }
      // A parked block is handed out again with no wait: it has none to keep.
      if (b->quick && (!b->waits.empty() || !b->last_streams.empty())) {
        fail("free bins", block_name(b) + where + " is parked but carries waits or last streams");
      }
      if ((b->address % min_block) != 0 || (b->size % min_block) != 0) {
        fail("neighbours", block_name(b) + where + " lies off the " + std::to_string(min_block) + "-byte grid");
      }
      parked_found += b->quick ? 1 : 0;
      // neighbours
      if (b->next != nullptr && settled_free(b) && settled_free(b->next)) {
        fail("neighbours", block_name(b) + " and " + block_name(b->next) + where +
                               " are neighbouring settled free blocks (they should have merged)");
      }
      if (b->next != nullptr && !b->mapped && !b->next->mapped) {
        fail("neighbours", block_name(b) + " and " + block_name(b->next) + where +
                               " are neighbouring unmapped blocks (they should have merged)");
      }
      // states
      // Every block outside the bins is indexed: allocated, tombstones (so
      // their owners' late frees find them), pending and parked.
      const bool indexed = b->state != block_state::free || b->quick;
      if (indexed != (pool.by_address.find(b->address) == b)) {
        fail("states", block_name(b) + where +
                           (indexed ? " is missing from the pool's index" : " is settled free but in the pool's index"));
      }
      if (b->state == block_state::invalidated && (b->size != min_block || !b->mapped)) {
        fail("states", block_name(b) + where + " is a tombstone not of " + std::to_string(min_block) +
                           " mapped bytes");
      }
      if (b->claimed && b->state != block_state::allocated) {
        fail("states", block_name(b) + where + " is claimed by an owner but is not allocated");
      }
      // record_stream's streams are let go (held no more) when the block is freed.
      if (!b->used_on.empty() && b->state != block_state::allocated) {
        fail("states", block_name(b) + where + " still holds streams recorded on it but is not allocated");
      }
      if (b->held_outside && b->state != block_state::allocated) {
        fail("states", block_name(b) + where + " is marked shared with another process but is not allocated");
      }
      if ((b->state == block_state::pending_free) != pending.contains(b)) {
        fail("states", block_name(b) + where +
                           (pending.contains(b) ? " is in the pending list" : " is missing from the pending list"));
      }
      const bool active_state = b->state == block_state::allocated || b->state == block_state::pending_free;
      if (!active_state && b->requested != 0) {
        fail("states", block_name(b) + where + " still records " + std::to_string(b->requested) + " requested bytes");
      }
      // counters
      if (b->counted_inactive_split != counts_as_inactive_split(b)) {
        fail("counters", block_name(b) + where + (b->counted_inactive_split ? " is counted" : " is not counted") +
                             " in inactive_split, against its state");
      }
      if (b->state == block_state::allocated) {
        ++allocations;
        allocated_bytes += size;
      }
      if (active_state) {
        ++active;
        active_bytes += size;
        requested_bytes += static_cast<std::int64_t>(b->requested);
      }
      if (b->state == block_state::invalidated) {
        ++invalidated;
        invalidated_bytes += size;
      }
      pending_found += b->state == block_state::pending_free ? 1 : 0;
      if (counts_as_inactive_split(b)) {
        ++inactive_split;
        inactive_split_bytes += size;
      }
    }
  }
  if (in_bins.size() != settled) {
    fail("free bins", "the " + pool_name(pool) + "'s free bins hold " + std::to_string(in_bins.size()) +
                          " blocks but its segments have " + std::to_string(settled) + " settled free blocks");
  }
  if (parked.size() != pool.quick_count || parked_found != pool.quick_count) {
    fail("free bins", "the " + pool_name(pool) + "'s quick list holds " + std::to_string(pool.quick_count) +
                          " entries but its segments have " + std::to_string(parked_found) + " parked blocks");
  }
  for (const block* b : pool.awaiting) {
    if (!pending.contains(b)) fail("states", block_name(b) + " awaits an event in the " + pool_name(pool) + " but is not pending");
  }
  std::size_t awaiting_found = 0, shared_found = 0;
  for (const block* b : pool.pending) {
    awaiting_found += b->waits.empty() ? 1 : 0;
    shared_found += b->wait_shared ? 1 : 0;
  }
  std::size_t holders = 0;
  for (const auto& g : pool.sealed) holders += g.holders;
  if (awaiting_found != pool.awaiting.size() || holders != shared_found) {
    fail("states", "the " + pool_name(pool) + " has " + std::to_string(pool.awaiting.size()) + " awaiting frees and " +
                       std::to_string(holders) + " holders of shared events, but its pending list has " +
                       std::to_string(awaiting_found) + " blocks without an event and " + std::to_string(shared_found) +
                       " sharing one");
  }
  if (pending_found != pool.pending.size()) {
    fail("states", "the " + pool_name(pool) + "'s pending list holds " + std::to_string(pool.pending.size()) +
                       " blocks but its segments have " + std::to_string(pending_found) + " pending_free blocks");
  }
  if (pool.by_address.size() != static_cast<std::size_t>(allocations + invalidated) + pending_found + pool.quick_count) {
    fail("states", "the " + pool_name(pool) + "'s index holds " + std::to_string(pool.by_address.size()) +
                       " blocks but its segments have " + std::to_string(allocations) + " allocated blocks, " +
                       std::to_string(invalidated) + " tombstones, " + std::to_string(pending_found) +
                       " pending frees and " + std::to_string(pool.quick_count) + " parked blocks");
  }
  const pool_counters& c = pool.counters;
  check_counter(pool, "allocations", c.allocations, allocations);
  check_counter(pool, "allocated_bytes", c.allocated_bytes, allocated_bytes);
  check_counter(pool, "requested_bytes", c.requested_bytes, requested_bytes);
  check_counter(pool, "active", c.active, active);
  check_counter(pool, "active_bytes", c.active_bytes, active_bytes);
  check_counter(pool, "segments", c.segments, static_cast<std::int64_t>(pool.segments.size()));
  check_counter(pool, "reserved_bytes", c.reserved_bytes, reserved);
  check_counter(pool, "inactive_split", c.inactive_split, inactive_split);
  check_counter(pool, "inactive_split_bytes", c.inactive_split_bytes, inactive_split_bytes);
  check_counter(pool, "invalidated", c.invalidated, invalidated);
  check_counter(pool, "invalidated_bytes", c.invalidated_bytes, invalidated_bytes);
}

}  // namespace

void check_allocator_invariants(const pool_directory& directory, const segment_source& source,
                                const orphaned_tombstones& orphans, std::size_t granularity) {
  directory.with_every_pool_locked([&](const std::vector<block_pool*>& pools, const segment_map& segments) {
    std::size_t segment_count = 0;
    std::size_t reserved = 0, growable_mapped = 0;
    std::unordered_set<std::uint64_t> numbers;
    for (const block_pool* pool : pools) {
      check_pool(*pool, granularity);
      if (!pool->is_private || pool->grows) reserved += static_cast<std::size_t>(pool->counters.reserved_bytes.current);
      std::uint64_t previous = 0;
      for (const auto& s : pool->segments) {
        ++segment_count;
        if (s->sequence <= previous || !numbers.insert(s->sequence).second) {
          fail("numbers", segment_name(*s) + " of the " + pool_name(*pool) + " has number " +
                              std::to_string(s->sequence) + (s->sequence == 0 ? " (none)" : "") +
                              ", after a segment numbered " + std::to_string(previous) +
                              " in its pool or the same as another's");
        }
        previous = s->sequence;
        if (s->expandable) growable_mapped += s->mapped_bytes;
        const auto it = segments.find(s->base);
        if (it == segments.end()) {
          fail("directory", segment_name(*s) + " of the " + pool_name(*pool) + " is missing from the segment directory");
        }
        if (it->second.first != s->size || it->second.second != pool) {
          fail("directory", "the segment directory records " + segment_name(*s) + " of the " + pool_name(*pool) +
                                " with " + std::to_string(it->second.first) + " bytes and another pool");
        }
        // In memory the allocator took from the device, a block may start
        // at an orphan's address only once it is a tombstone here again (a
        // growable range lies over none at all). A private pool's region
        // takes its orphans while it enters the directory: not checked.
        if (s->external) continue;
        for (const std::uintptr_t address : orphans.within(s->base, s->base + s->size)) {
          if (s->expandable || (address - s->base) % min_block == 0) {
            fail("orphans", "an orphaned tombstone at " + hex(address) + " lies in " + segment_name(*s) +
                                " of the " + pool_name(*pool) + ", where a block may start");
          }
        }
      }
    }
    if (segments.size() != segment_count) {
      fail("directory", "the segment directory holds " + std::to_string(segments.size()) +
                            " segments but the pools have " + std::to_string(segment_count));
    }
    // Chunks kept for re-mapping live inside one growth only: between calls
    // every physical chunk held is mapped, so reserved memory is all of it.
    if (growable_mapped != source.physical_chunk_bytes()) {
      fail("counters", "the growable segments map " + std::to_string(growable_mapped) +
                           " bytes but the segment source holds physical chunks of " +
                           std::to_string(source.physical_chunk_bytes()) + " bytes");
    }
    const std::size_t counted = source.reserved_in_pools();
    if (reserved != counted || source.reserved_total() > source.ceiling()) {
      fail("counters", "the stream pools reserve " + std::to_string(reserved) + " bytes but the segment source counts " +
                           std::to_string(counted) + " (" + std::to_string(source.reserved_total()) +
                           " with detached segments) against a limit of " +
                           std::to_string(source.ceiling()));
    }
  });
  directory.with_stream_pools_listed(
      [](const std::vector<stream_pools*>& serving, const std::vector<stream_pools*>& vacant) {
        const auto check = [](block_pool& pool, bool is_vacant) {
          std::lock_guard lock(pool.lock);
          if (pool.vacant != is_vacant) {
            fail("vacant", "the " + pool_name(pool) + (is_vacant ? " is vacant but not marked so" : " is marked vacant but serves a stream"));
          }
          if (is_vacant && (pool.by_address.size() != pool.quick_count || !pool.pending.empty() ||
                            !pool.awaiting.empty() || !pool.sealed.empty() || !pool.stream.is_default())) {
            fail("vacant", "the vacant " + pool_name(pool) + " holds a live or pending block, or names a stream");
          }
        };
        for (stream_pools* p : serving) {
          check(p->small, false);
          check(p->large, false);
        }
        for (stream_pools* p : vacant) {
          check(p->small, true);
          check(p->large, true);
        }
      });
}

}  // namespace shoal::alloc::detail
