// Checkpoints of growing private pools: a pool's layout taken, and laid out
// again later (CUDA graph trees return a graph pool to the layout an earlier
// capture left, PyTorch's getCheckpointState / setCheckpointPoolState).
//
// A restore runs in two phases under the pool's lock, as a forced clear
// does: everything that may throw comes first (the checks, block objects
// with room for their last streams, room in the index, the device waits,
// debug mode's poison of what it leaves free) and changes no block; then
// the layout is rebuilt by steps that throw nothing, so a failure never
// leaves half a layout.
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/event_pool.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

void require_growing(const block_pool& part, private_pool_id id, const char* op) {
  if (part.grows) return;
  throw invalid_argument(std::string(op) + ": private pool " + std::to_string(id.value) +
                         " is memory handed in, not a growing private pool (create_growing_private_pool)");
}

// The checkpoint's segments, each matched to the pool's segment at its base;
// throws unless every one is there, with its size, and its blocks tile it.
std::map<const segment*, const pool_checkpoint::segment_state*> match_segments(const block_pool& part,
                                                                              const pool_checkpoint& checkpoint,
                                                                              const char* op) {
  std::map<std::uintptr_t, const segment*> by_base;
  for (const auto& s : part.segments) by_base.emplace(s->base, s.get());
  std::map<const segment*, const pool_checkpoint::segment_state*> matched;
  for (const auto& saved : checkpoint.segments) {
    const auto found = by_base.find(saved.base);
    if (found == by_base.end() || found->second->size != saved.size) {
      throw invalid_argument(std::string(op) + ": the pool has no segment of " + std::to_string(saved.size) +
                             " bytes at " + hex(saved.base) + " as the checkpoint has");
    }
    if (!matched.emplace(found->second, &saved).second) {
      throw invalid_argument(std::string(op) + ": the checkpoint lists the segment at " + hex(saved.base) + " twice");
    }
    std::uintptr_t at = saved.base;
    for (const auto& b : saved.blocks) {
      if (b.address != at || b.size == 0 || b.size % min_block != 0 || b.size > saved.base + saved.size - at) {
        throw invalid_argument(std::string(op) + ": the checkpoint's blocks do not tile its segment at " +
                               hex(saved.base) + " (a block of " + std::to_string(b.size) + " bytes at " +
                               hex(b.address) + ")");
      }
      at += b.size;
    }
    if (at != saved.base + saved.size) {
      throw invalid_argument(std::string(op) + ": the checkpoint's blocks do not cover its segment at " +
                             hex(saved.base));
    }
  }
  return matched;
}

// The blocks a segment is rebuilt with: the checkpoint's, neighbouring free
// ones as one (free blocks never lie side by side), or one free block for a
// segment taken since the checkpoint.
std::vector<pool_checkpoint::block_state> layout_after(const segment& s, const pool_checkpoint::segment_state* saved) {
  if (saved == nullptr) return {{s.base, s.size, false, 0, {}}};
  std::vector<pool_checkpoint::block_state> out;
  out.reserve(saved->blocks.size());
  for (const auto& b : saved->blocks) {
    if (!b.allocated && !out.empty() && !out.back().allocated) {
      out.back().size += b.size;
      continue;
    }
    out.push_back(b);
  }
  return out;
}

// `later` waits on the device for the work queued on `earlier` so far.
void order_after(backend::device& device, event_pool& events, backend::stream_ref later, backend::stream_ref earlier) {
  const backend::event_ref e = events.take();
  try {
    device.record(e, earlier);
    device.wait(later, e);
  } catch (...) {
    events.give_back(e);
    throw;
  }
  events.give_back(e);
}

// Debug mode: the poison of what a restore leaves free, as every free is
// poisoned. Filled on the first old user's stream once the others' work is
// passed; every old user is a free block's last stream, so whoever takes
// that memory next waits for the fill too.
void poison_left_free(backend::device& device, event_pool& events,
                      const std::vector<std::vector<pool_checkpoint::block_state>>& layouts,
                      const std::vector<backend::stream_ref>& used) {
  const backend::stream_ref on = used.front();
  for (std::size_t i = 1; i < used.size(); ++i) order_after(device, events, on, used[i]);
  for (const auto& layout : layouts) {
    for (const auto& b : layout) {
      if (!b.allocated) device.fill(on, reinterpret_cast<void*>(b.address), poison_byte, b.size);
    }
  }
}

}  // namespace

pool_checkpoint allocator_core::checkpoint_private_pool(private_pool_id id) {
  refuse_in_fork_child(epoch_, "checkpoint_private_pool");
  block_pool& part = private_part(id, "");
  require_growing(part, id, "checkpoint_private_pool");
  pool_checkpoint out;
  out.pool = id;
  {
    std::lock_guard lock(part.lock);
    out.segments.reserve(part.segments.size());
    for (const auto& s : part.segments) {
      auto& saved = out.segments.emplace_back();
      saved.base = s->base;
      saved.size = s->size;
      for (const block* b = s->first; b != nullptr; b = b->next) {
        const bool allocated = b->state == block_state::allocated;
        saved.blocks.push_back({b->address, b->size, allocated, allocated ? b->requested : 0,
                                allocated ? b->stream : backend::stream_ref{}});
      }
    }
  }
  std::sort(out.segments.begin(), out.segments.end(), [](const auto& a, const auto& b) { return a.base < b.base; });
  return out;
}

pool_restore_result allocator_core::restore_private_pool(private_pool_id id, const pool_checkpoint& checkpoint) {
  refuse_in_fork_child(epoch_, "restore_private_pool");
  constexpr const char* op = "restore_private_pool";
  if (checkpoint.pool != id) {
    throw invalid_argument(std::string(op) + ": the checkpoint is of private pool " +
                           std::to_string(checkpoint.pool.value) + ", not " + std::to_string(id.value));
  }
  block_pool& part = private_part(id, "");
  require_growing(part, id, op);
  // Its pending frees complete first, waited for on the host without the
  // lock (a free that came meanwhile sends us round again). Only those: the
  // streams that used its free blocks are waited for on the device below.
  std::unique_lock lock(part.lock);
  for (;;) {
    collect_pending(part, false);
    if (part.pending.empty()) break;
    std::vector<backend::event_ref> waits;
    for (const block* b : part.pending) waits.insert(waits.end(), b->waits.begin(), b->waits.end());
    lock.unlock();
    for (auto e : waits) device.synchronize_event(e);
    lock.lock();
  }

  // ---- phase 1: everything that may throw; nothing changes
  const auto matched = match_segments(part, checkpoint, op);
  std::vector<backend::stream_ref> used;  // every stream that may still touch the pool's memory
  std::size_t live = 0;
  for (const auto& s : part.segments) {
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->state == block_state::invalidated) {
        // An orphaned tombstone a new segment kept (forced_clear.cpp): its
        // owner's late free is owed, and no block may start at its address.
        throw invalid_argument(std::string(op) + ": a tombstone lies at " + hex(b->address) +
                               " in the pool's memory until its owner's late free; nothing was changed");
      }
      if (b->state == block_state::allocated) {
        if (b->held_outside) {
          throw invalid_argument(std::string(op) + ": block " + hex(b->address) + " (" + std::to_string(b->size) +
                                 " bytes) is shared with another process, which may still use it; nothing was "
                                 "changed");
        }
        ++live;
        add_unique(used, b->stream);
        for (auto on : b->used_on) add_unique(used, on);
      } else {
        for (auto on : b->last_streams) add_unique(used, on);
      }
    }
  }
  std::vector<backend::stream_ref> owners;  // the streams of the checkpoint's allocated blocks
  std::size_t restored = 0;
  for (const auto& saved : checkpoint.segments) {
    for (const auto& b : saved.blocks) {
      if (!b.allocated) continue;
      ++restored;
      add_unique(owners, b.stream);
    }
  }
  std::vector<std::vector<pool_checkpoint::block_state>> layouts;  // one per segment, in part.segments' order
  layouts.reserve(part.segments.size());
  std::size_t needed = 0;
  for (const auto& s : part.segments) {
    const auto found = matched.find(s.get());
    needed += layouts.emplace_back(layout_after(*s, found == matched.end() ? nullptr : found->second)).size();
  }
  pool_restore_result result;
  result.freed.reserve(live);
  result.allocated.reserve(restored);
  part.by_address.reserve(restored);
  part.reserve_blocks(needed);
  std::vector<block*> fresh;  // one per layout entry, taken now so that phase 2 allocates nothing
  fresh.reserve(needed);
  try {
    for (std::size_t i = 0; i < needed; ++i) {
      fresh.push_back(part.new_block());
      fresh.back()->last_streams.reserve(used.size());
    }
    // The new owners' streams wait for the old users' work on the device.
    for (auto owner : owners) {
      for (auto s : used) {
        if (s != owner) order_after(device, events_, owner, s);
      }
    }
    // Last: a fill that fails changes no block (though memory the restore
    // would have freed may hold the poison by then).
    if (config.debug && !used.empty()) poison_left_free(device, events_, layouts, used);
    // After everything else that may throw (a hold, only std::bad_alloc): the
    // free blocks remember these streams as their last (record_stream's among
    // them), held so that a later hand-out may wait for them.
    for (auto s : used) held_streams_.hold(s);
  } catch (...) {
    for (block* b : fresh) part.recycle(b);
    throw;
  }

  // ---- phase 2: the layout rebuilt; nothing throws
  auto& c = part.counters;
  std::size_t next_fresh = 0;
  auto layout = layouts.begin();
  for (auto& s : part.segments) {
    for (block* b = s->first; b != nullptr;) {
      block* const next = b->next;
      if (b->state == block_state::allocated) {
        (void)part.by_address.take(b->address);
        pool_counters::sub(c.allocations, 1);
        pool_counters::sub(c.allocated_bytes, static_cast<std::int64_t>(b->size));
        pool_counters::sub(c.active, 1);
        pool_counters::sub(c.active_bytes, static_cast<std::int64_t>(b->size));
        pool_counters::sub(c.requested_bytes, static_cast<std::int64_t>(b->requested));
        result.freed.push_back(b->address);
        // Its record_stream streams are held_streams_' now (phase 1): the
        // holds note_used_on took end here, as a free's would.
        let_used_on_go(b);
        ++part.frees;  // a free, for those who watch for frees while they wait (forget_last_streams)
        if (trace_.enabled()) {
          trace_.note(trace_action::free_requested, b->address, b->size, b->stream);
          trace_.note(trace_action::free_completed, b->address, b->size, b->stream);
        }
      } else {
        part.bins.remove(b);  // free and settled: private pools park nothing
        give_back_waits(b, events_);
      }
      recycle(part, b);
      b = next;
    }
    s->first = nullptr;
    block* last = nullptr;
    for (const auto& saved : *layout++) {
      block* b = fresh[next_fresh++];
      b->address = saved.address;
      b->size = saved.size;
      b->owner = s.get();
      b->prev = last;
      (last != nullptr ? last->next : s->first) = b;
      last = b;
      if (saved.allocated) {
        b->state = block_state::allocated;
        b->requested = saved.requested;
        b->stream = saved.stream;
        part.by_address.insert(b);  // within the room reserved above
        pool_counters::add(c.allocations, 1);
        pool_counters::add(c.allocated_bytes, static_cast<std::int64_t>(b->size));
        pool_counters::add(c.active, 1);
        pool_counters::add(c.active_bytes, static_cast<std::int64_t>(b->size));
        pool_counters::add(c.requested_bytes, static_cast<std::int64_t>(b->requested));
        result.allocated.push_back({b->address, b->size, b->stream});  // within the room reserved above
        if (trace_.enabled()) trace_.note(trace_action::alloc, b->address, b->size, b->stream);
      } else {
        b->last_streams.assign(used.begin(), used.end());  // within the room reserved above
      }
    }
    for (block* b = s->first; b != nullptr; b = b->next) {  // once its neighbours are linked
      if (b->state != block_state::free) continue;
      part.bins.insert(b);
      refresh_split_stat(part, b);
    }
  }
  lock.unlock();
  check_step();
  return result;
}

}  // namespace shoal::alloc::detail
