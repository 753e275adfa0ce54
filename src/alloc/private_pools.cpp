// Private pools: memory handed in from outside, split into named sub-pools.
#include <mutex>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

private_pool_id allocator_core::create_private_pool(void* base, std::size_t bytes,
                                                    const std::vector<std::pair<std::string, std::size_t>>& parts) {
  const auto start = reinterpret_cast<std::uintptr_t>(base);
  if (base == nullptr || bytes == 0) throw invalid_argument("create_private_pool: the region is empty or null");
  if (start % min_block != 0) throw invalid_argument("create_private_pool: the region must be 512-byte aligned");
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
    total += size;
  }
  if (total > bytes) {
    throw invalid_argument("create_private_pool: the sub-pools need " + std::to_string(total) +
                           " bytes but the region has " + std::to_string(bytes));
  }
  auto pool = std::make_unique<private_pool>();
  std::uintptr_t at = start;
  for (const auto& [name, size] : layout) {
    auto part = directory_.new_private_part();
    part->kind = pool_kind::large;
    part->is_private = true;
    part->part_name = name;
    auto s = std::make_unique<segment>();
    s->base = at;
    s->size = s->mapped_bytes = size;
    s->pool = part.get();
    s->external = true;
    s->part_name = name;
    block* b = part->new_block();
    b->address = at;
    b->size = size;
    b->owner = s.get();
    s->first = b;
    part->bins.insert(b);
    directory_.register_segment(*s);
    part->segments.push_back(std::move(s));
    pool_counters::add(part->counters.segments, 1);
    pool_counters::add(part->counters.reserved_bytes, static_cast<std::int64_t>(size));
    pool->parts.push_back(std::move(part));
    at += size;
  }
  const private_pool_id id = directory_.add_private_pool(std::move(pool));
  if constexpr (check_every_step) check_invariants();
  return id;
}

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

// Makes each segment of the sub-pool free again but for its tombstones,
// which stay where they are (forced_clear.cpp): one free block between two
// tombstones. Every block (tombstones included) then remembers `still_used`,
// streams a hand-out must wait for. The sub-pool has no live block.
void reset_layout(block_pool& part, const std::vector<backend::stream_ref>& still_used) {
  for (auto& s : part.segments) {
    std::vector<block*> tombstones;
    for (block* b = s->first; b != nullptr;) {
      block* next = b->next;
      if (b->state == block_state::invalidated) {
        tombstones.push_back(b);
      } else {
        part.bins.remove(b);  // free and settled: private pools park nothing
        recycle(part, b);
      }
      b = next;
    }
    block* last = nullptr;
    std::uintptr_t at = s->base;
    const auto append = [&](block* b) {
      b->prev = last;
      b->next = nullptr;
      (last != nullptr ? last->next : s->first) = b;
      last = b;
      at = b->address + b->size;
    };
    const auto append_free = [&](std::uintptr_t end) {
      if (end == at) return;
      block* b = part.new_block();
      b->address = at;
      b->size = end - at;
      b->owner = s.get();
      append(b);
    };
    for (block* t : tombstones) {
      append_free(t->address);
      append(t);
    }
    append_free(s->base + s->size);
    for (block* b = s->first; b != nullptr; b = b->next) {
      for (auto stream : still_used) add_unique(b->last_streams, stream);
      if (b->state != block_state::free) continue;
      part.bins.insert(b);
      refresh_split_stat(part, b);
    }
  }
}

}  // namespace

invalidated_blocks_report allocator_core::clear_private_pool(private_pool_id id, const std::string& part_name,
                                                             live_blocks live) {
  block_pool& part = private_part(id, part_name);
  // A stream the allocator never heard of (used without record_stream) may
  // still touch a live block: only the whole device passing is enough.
  if (live == live_blocks::invalidate) device.synchronize_device();
  invalidated_blocks_report taken;
  {
    std::lock_guard lock(part.lock);
    // The memory is forgotten, not just its layout: the streams that last
    // used it have passed (drain_private_pool, or the device above).
    std::vector<backend::stream_ref> still_used;
    if (live == live_blocks::invalidate) {
      refuse_held_outside(part);
      taken = take_back_live_blocks(part, still_used);
    }
    require_no_live_blocks(part, "clear_private_pool");
    reset_layout(part, still_used);
  }
  if constexpr (check_every_step) check_invariants();
  return taken;
}

void allocator_core::drain_private_pool(private_pool_id id, const std::string& part_name) {
  block_pool& part = private_part(id, part_name);
  // Waited for without the lock: this may take long.
  std::vector<backend::event_ref> waits;
  {
    std::lock_guard lock(part.lock);
    for (block* b : part.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
  }
  for (auto e : waits) device.synchronize_event(e);
  std::vector<backend::stream_ref> streams;
  {
    std::lock_guard lock(part.lock);
    collect_pending(part, false);
    for (auto& s : part.segments) {
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->state == block_state::free) {
          for (auto stream : b->last_streams) add_unique(streams, stream);
        }
      }
    }
  }
  for (auto stream : streams) device.synchronize(stream);
}

invalidated_blocks_report allocator_core::destroy_private_pool(private_pool_id id, live_blocks live) {
  if (live == live_blocks::invalidate) {
    device.synchronize_device();  // as clear_private_pool does
    for (block_pool* part : directory_.private_parts(id)) {  // before any is changed
      std::lock_guard lock(part->lock);
      refuse_held_outside(*part);
    }
  }
  invalidated_blocks_report taken;
  std::vector<backend::stream_ref> poisoned;  // debug mode: fills still queued on the memory
  // Tombstones go with the pool's segments: a late free after this is an
  // unknown pointer.
  directory_.remove_private_pool(id, [&](block_pool& part) {
    if (live == live_blocks::invalidate) {
      const auto report = take_back_live_blocks(part, poisoned);
      taken.blocks.insert(taken.blocks.end(), report.blocks.begin(), report.blocks.end());
      taken.bytes += report.bytes;
    }
    require_no_live_blocks(part, "destroy_private_pool");
  });
  // The memory goes back to its owner when this returns: no fill may be
  // left queued on it.
  for (auto stream : poisoned) device.synchronize(stream);
  if constexpr (check_every_step) check_invariants();
  return taken;
}

}  // namespace shoal::alloc::detail
