// Private pools: memory handed in from outside, split into named sub-pools.
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

// Throws unless every block of the sub-pool is free (or a tombstone).
void require_no_live_blocks(block_pool& part, const char* op) {
  std::size_t live = 0, live_bytes = 0;
  for (auto& s : part.segments) {
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->state == block_state::allocated || b->state == block_state::pending_free) {
        ++live;
        live_bytes += b->size;
      }
    }
  }
  if (live > 0) {
    throw invalid_argument(std::string(op) + ": sub-pool '" + part.part_name + "' still has " + std::to_string(live) +
                           " live block(s) (" + std::to_string(live_bytes) +
                           " bytes, allocated or waiting for a stream); free them first, or force it "
                           "(live_blocks::invalidate)");
  }
}

// Block objects reset_layout may need: one free block before each
// tombstone, and one more per segment, after prepare_take_back (so
// allocated blocks count as the tombstones they become).
std::size_t blocks_for_reset(const block_pool& part) {
  std::size_t n = 0;
  for (const auto& s : part.segments) {
    ++n;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      n += b->state == block_state::invalidated || b->state == block_state::allocated ? 1 : 0;
    }
  }
  return n;
}

// Makes each segment of the sub-pool free again but for its tombstones,
// which stay where they are (forced_clear.cpp): one free block between two
// tombstones, remembering no stream (the streams that last used the memory
// have passed: the drain of a clear that refuses live blocks, or a forced
// clear's device-wide wait).
// Every block is free (in the bins) or a tombstone; blocks_for_reset(part)
// block objects are spare, so nothing here allocates or throws. A free
// block's waits (debug mode's hazard events, with cross-stream safety off)
// go back to `events`: their streams have passed too.
void reset_layout(block_pool& part, event_pool& events) {
  for (auto& s : part.segments) {
    block* b = s->first;
    block* last = nullptr;
    std::uintptr_t at = s->base;
    const auto append = [&](block* appended) {
      appended->prev = last;
      appended->next = nullptr;
      (last != nullptr ? last->next : s->first) = appended;
      last = appended;
      at = appended->address + appended->size;
    };
    const auto append_free = [&](std::uintptr_t end) {
      if (end == at) return;
      block* fresh = part.new_block();
      fresh->address = at;
      fresh->size = end - at;
      fresh->owner = s.get();
      append(fresh);
    };
    s->first = nullptr;
    while (b != nullptr) {
      block* next = b->next;
      if (b->state == block_state::invalidated) {
        append_free(b->address);
        append(b);
      } else {
        part.bins.remove(b);  // free and settled: private pools park nothing
        give_back_waits(b, events);
        recycle(part, b);
      }
      b = next;
    }
    append_free(s->base + s->size);
    for (block* fresh = s->first; fresh != nullptr; fresh = fresh->next) {  // once its neighbours are linked
      if (fresh->state != block_state::free) continue;
      part.bins.insert(fresh);
      refresh_split_stat(part, fresh);
    }
  }
}

// A growing pool's segments go back to the device: a tombstone left in one
// would outlive its memory, and a late free could then free a newer block.
void require_refuse_for_growing(const block_pool& part, live_blocks live, const char* op) {
  if (live == live_blocks::refuse || !part.grows) return;
  throw invalid_argument(std::string(op) +
                         ": a growing private pool's blocks cannot be taken back (live_blocks::invalidate); free "
                         "them, then destroy it with live_blocks::refuse");
}

// Debug mode: poison of the whole sub-pool, on the default stream (always
// there, unlike the streams of taken blocks), after its layout was reset.
void poison(backend::device& device, const block_pool& part) {
  for (const auto& s : part.segments) device.fill({}, reinterpret_cast<void*>(s->base), poison_byte, s->size);
}

// A destroyed pool's free blocks may carry debug mode's hazard events
// (cross-stream safety off); their objects are recycled as the pool is
// emptied (pool_directory's empty_for_reuse), so the events go back first.
void give_back_hazard_events(block_pool& part, event_pool& events) noexcept {
  for (const auto& s : part.segments) {
    for (block* b = s->first; b != nullptr; b = b->next) {
      if (b->state != block_state::invalidated) give_back_waits(b, events);
    }
  }
}

// The frees of a pool's sub-pools, whose locks the caller holds.
std::uint64_t frees_in(const std::vector<block_pool*>& parts) {
  std::uint64_t frees = 0;
  for (const block_pool* part : parts) frees += part->frees;
  return frees;
}

std::uint64_t frees_of(block_pool& part) {
  std::lock_guard lock(part.lock);
  return part.frees;
}

}  // namespace

private_pool_id allocator_core::create_private_pool(void* base, std::size_t bytes,
                                                    const std::vector<std::pair<std::string, std::size_t>>& parts) {
  refuse_in_fork_child(epoch_, "create_private_pool");
  const auto start = reinterpret_cast<std::uintptr_t>(base);
  if (base == nullptr || bytes == 0) throw invalid_argument("create_private_pool: the region is empty or null");
  if (start % min_block != 0) throw invalid_argument("create_private_pool: the region must be 512-byte aligned");
  if (bytes > UINTPTR_MAX - start) throw invalid_argument("create_private_pool: the region wraps past the end of memory");
  std::vector<std::pair<std::string, std::size_t>> layout = parts;
  if (layout.empty()) layout.emplace_back("", bytes);
  std::size_t total = 0;
  for (const auto& [name, size] : layout) {
    if (size == 0 || size % min_block != 0) {
      throw invalid_argument("create_private_pool: sub-pool '" + name + "' has " + std::to_string(size) +
                             " bytes; give each a positive multiple of 512");
    }
    for (const auto& [other, ignored] : layout) {
      if (&other != &name && other == name)
        throw invalid_argument("create_private_pool: two sub-pools are named '" + name + "'");
    }
    if (__builtin_add_overflow(total, size, &total)) {
      throw invalid_argument("create_private_pool: the sub-pools' sizes add up past 2**64 bytes");
    }
  }
  if (total > bytes) {
    throw invalid_argument("create_private_pool: the sub-pools need " + std::to_string(total) +
                           " bytes but the region has " + std::to_string(bytes));
  }
  // Tombstones a destroyed pool left here become tombstones again, so that
  // their late frees free nothing newer (orphaned_tombstones.h). No late
  // free takes one while they change hands (region_handoff_mutex_).
  std::lock_guard handoff(region_handoff_mutex_);
  const std::vector<std::uintptr_t> orphans = orphans_.within(start, start + total);
  auto pool = std::make_unique<private_pool>();
  pool->parts.reserve(layout.size());  // a reused sub-pool is never dropped on the way in
  try {
    std::uintptr_t at = start;
    auto orphan = orphans.begin();
    for (const auto& [name, size] : layout) {
      pool->parts.push_back(directory_.new_private_part());
      block_pool& part = *pool->parts.back();
      // A reused sub-pool: a stale per-thread cache entry may lead to it.
      std::lock_guard part_lock(part.lock);
      part.kind = pool_kind::large;
      part.is_private = true;
      part.part_name = name;
      part.segments.push_back(std::make_unique<segment>());
      segment& s = *part.segments.back();
      s.base = at;
      s.size = s.mapped_bytes = size;
      s.pool = &part;
      s.external = true;
      s.part_name = name;
      s.sequence = directory_.next_segment_sequence();
      block* last = nullptr;
      for (; orphan != orphans.end() && *orphan < at + size; ++orphan) {
        block* t = part.new_block();
        t->address = *orphan;
        t->size = min_block;
        t->owner = &s;
        t->state = block_state::invalidated;
        t->prev = last;
        (last != nullptr ? last->next : s.first) = t;
        last = t;
        part.by_address.insert(t);
        pool_counters::add(part.counters.invalidated, 1);
        pool_counters::add(part.counters.invalidated_bytes, static_cast<std::int64_t>(min_block));
      }
      part.reserve_blocks(blocks_for_reset(part));
      reset_layout(part, events_);  // the free memory around them
      pool_counters::add(part.counters.segments, 1);
      pool_counters::add(part.counters.reserved_bytes, static_cast<std::int64_t>(size));
      at += size;
    }
    const private_pool_id id = directory_.add_private_pool(pool);  // in service from now on
    orphans_.forget_all(orphans);  // tombstones again, no longer orphans
    check_step();
    return id;
  } catch (...) {
    // Out of memory midway: nothing was registered and no free found a
    // sub-pool (out of service); the sub-pools go back for reuse, emptied
    // (their tombstones are still orphans).
    if (pool) directory_.discard_private_pool(std::move(pool));
    throw;
  }
}

private_pool_id allocator_core::create_growing_private_pool() {
  refuse_in_fork_child(epoch_, "create_growing_private_pool");
  auto pool = std::make_unique<private_pool>();
  pool->parts.reserve(1);  // a reused sub-pool is never dropped on the way in
  pool->parts.push_back(directory_.new_private_part());
  {
    block_pool& part = *pool->parts.back();
    std::lock_guard part_lock(part.lock);  // a stale per-thread cache entry may lead to it
    part.kind = pool_kind::large;
    part.is_private = true;
    part.grows = true;
  }
  try {
    return directory_.add_private_pool(pool);
  } catch (...) {
    directory_.discard_private_pool(std::move(pool));
    throw;
  }
}

void allocator_core::forget_last_streams(private_pool_id id) {
  refuse_in_fork_child(epoch_, "forget_last_streams");
  block_pool& part = private_part(id, "");
  // Only streams the drain waited for may be forgotten: a free that came
  // meanwhile (another thread's) sends us round again.
  for (std::uint64_t frees = frees_of(part);;) {
    drain_private_pool(id, "");
    std::lock_guard lock(part.lock);
    if (std::exchange(frees, part.frees) != part.frees) continue;
    collect_pending(part, false);  // drained: every pending free has passed
    for (auto& s : part.segments) {
      for (block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::free) b->last_streams.clear();
      }
    }
    return;
  }
}

std::vector<void*> allocator_core::private_pool_allocated_blocks(private_pool_id id) const {
  refuse_in_fork_child(epoch_, "private_pool_allocated_blocks");
  std::vector<void*> out;
  for (block_pool* part : directory_.private_parts(id)) {
    std::lock_guard lock(part->lock);
    for (const auto& s : part->segments) {
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::allocated) out.push_back(reinterpret_cast<void*>(b->address));
      }
    }
  }
  return out;
}

invalidated_blocks_report allocator_core::clear_private_pool(private_pool_id id, const std::string& part_name,
                                                             live_blocks live) {
  refuse_in_fork_child(epoch_, "clear_private_pool");
  block_pool& part = private_part(id, part_name);
  require_refuse_for_growing(part, live, "clear_private_pool");
  invalidated_blocks_report taken;
  if (live == live_blocks::refuse) {
    // reset_layout forgets the streams that last used the free blocks: they
    // are waited for first, and again when a free came during the wait
    // (another thread's: its stream was not waited for).
    for (std::uint64_t frees = frees_of(part);;) {
      drain(part);
      std::lock_guard lock(part.lock);
      if (std::exchange(frees, part.frees) != part.frees) continue;
      require_no_live_blocks(part, "clear_private_pool");
      part.reserve_blocks(blocks_for_reset(part));
      reset_layout(part, events_);
      break;
    }
  } else {
    hooks.run_forced_clear_hooks();  // blocks no other process holds any more lose their mark
    std::uint64_t frees = frees_of(part);
    for (bool done = false; !done;) {
      // A stream the allocator never heard of (used without record_stream)
      // may still touch a live block: only the whole device passing is
      // enough. It covers the pending frees and the free blocks' last
      // streams too, unless a free came during the wait: then wait again.
      device.synchronize_device();
      std::lock_guard lock(part.lock);
      if (std::exchange(frees, part.frees) != part.frees) continue;
      prepare_take_back(part, "clear_private_pool", taken);  // phase 1: may throw, changes nothing
      part.reserve_blocks(blocks_for_reset(part));
      take_back_live_blocks(part, taken);  // phase 2: throws nothing
      reset_layout(part, events_);
      if (config.debug) poison(device, part);
      done = true;
    }
    // The poison is written before anything is handed out of the memory.
    if (config.debug) device.synchronize_device();
  }
  check_step();
  return taken;
}

void allocator_core::drain_private_pool(private_pool_id id, const std::string& part_name) {
  refuse_in_fork_child(epoch_, "drain_private_pool");
  drain(private_part(id, part_name));
}

void allocator_core::drain(block_pool& part) {
  // Waited for without the lock: this may take long.
  std::vector<backend::event_ref> waits;
  {
    std::lock_guard lock(part.lock);
    for (block* b : part.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
  }
  for (auto e : waits) device.synchronize_event(e);
  std::vector<backend::stream_ref> streams;
  waits.clear();
  {
    std::lock_guard lock(part.lock);
    collect_pending(part, false);
    for (auto& s : part.segments) {
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::free) {
          for (auto stream : b->last_streams) add_unique(streams, stream);
          // Debug mode's hazard events (cross-stream safety off): the
          // streams that freed the block, which reset_layout forgets.
          waits.insert(waits.end(), b->waits.begin(), b->waits.end());
        }
      }
    }
  }
  for (auto stream : streams) device.synchronize(stream);
  for (auto e : waits) device.synchronize_event(e);
}

invalidated_blocks_report allocator_core::destroy_private_pool(private_pool_id id, live_blocks live) {
  refuse_in_fork_child(epoch_, "destroy_private_pool");
  // The pool's tombstones outlive it as orphans (orphaned_tombstones.h):
  // room for every one it may have is made while nothing has changed yet.
  const auto make_room_for_orphans = [&](const std::vector<block_pool*>& parts) {
    std::size_t n = 0;
    for (const block_pool* part : parts) {
      for (const auto& s : part->segments) {
        for (const block* b = s->first; b != nullptr; b = b->next) {
          n += b->state == block_state::invalidated || b->state == block_state::allocated ? 1 : 0;
        }
      }
    }
    orphans_.reserve(n);
  };
  const auto orphan_tombstones = [&](const block_pool& part) {
    for (const auto& s : part.segments) {
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::invalidated) orphans_.add(b->address);
      }
    }
  };
  invalidated_blocks_report taken;
  bool grows = false;
  for (block_pool* part : directory_.private_parts(id)) {
    require_refuse_for_growing(*part, live, "destroy_private_pool");
    grows = grows || part->grows;
  }
  const auto frees_now = [&] {
    std::uint64_t frees = 0;
    for (block_pool* part : directory_.private_parts(id)) frees += frees_of(*part);
    return frees;
  };
  if (live == live_blocks::refuse) {
    // The memory leaves the allocator once the streams enqueued on it have
    // run (a pending free's stream, a free block's last streams): a growing
    // pool's segments go back to the device, a region handed in to its owner.
    // A free that came after the drain looked (its stream's work not waited
    // for) sends it round again.
    std::vector<std::pair<std::uintptr_t, std::size_t>> grown;
    for (bool removed = false; !removed;) {
      const std::uint64_t frees = frees_now();
      for (block_pool* part : directory_.private_parts(id)) drain(*part);
      std::unique_lock retired_lock(retired_mutex_);
      removed = directory_.remove_private_pool(
          id,
          [&](const std::vector<block_pool*>& parts) {
            if (frees_in(parts) != frees) return false;
            std::size_t segments = 0;
            for (block_pool* part : parts) {
              require_no_live_blocks(*part, "destroy_private_pool");
              if (part->grows) segments += part->segments.size();
            }
            make_room_for_orphans(parts);
            grown.reserve(segments);
            return true;
          },
          [&](block_pool& part) {
            give_back_hazard_events(part, events_);
            orphan_tombstones(part);
            retire_counters(part);
            if (!part.grows) return;
            for (const auto& s : part.segments) {
              grown.emplace_back(s->base, s->size);
              source_.note_detached(s->size);
            }
          });
    }
    source_.free_detached_segments(id, grown);
    check_step();
    return taken;
  }
  if (grows) drain_private_pool(id, "");
  hooks.run_forced_clear_hooks();  // blocks no other process holds any more lose their mark
  std::uint64_t frees = frees_now();
  std::vector<std::pair<std::uintptr_t, std::size_t>> memory;  // debug mode: to poison once it left
  for (bool removed = false; !removed;) {
    device.synchronize_device();  // as clear_private_pool does, and again after a free during it
    // Every sub-pool is checked, and held outside again, with all their
    // locks held before any is changed: a block sent meanwhile refuses it.
    std::lock_guard retired_lock(retired_mutex_);
    removed = directory_.remove_private_pool(
        id,
        [&](const std::vector<block_pool*>& parts) {
          const std::uint64_t now = frees_in(parts);
          if (std::exchange(frees, now) != now) return false;
          for (block_pool* part : parts) {
            prepare_take_back(*part, "destroy_private_pool", taken);
            if (!config.debug) continue;
            for (const auto& s : part->segments) memory.emplace_back(s->base, s->size);
          }
          make_room_for_orphans(parts);
          return true;
        },
        [&](block_pool& part) {
          take_back_live_blocks(part, taken);
          give_back_hazard_events(part, events_);
          orphan_tombstones(part);
          retire_counters(part);
        });
  }
  // The memory goes back to its owner when this returns: its poison must
  // have been written by then.
  for (const auto& [base, bytes] : memory) device.fill({}, reinterpret_cast<void*>(base), poison_byte, bytes);
  if (!memory.empty()) device.synchronize_device();
  check_step();
  return taken;
}

}  // namespace shoal::alloc::detail
