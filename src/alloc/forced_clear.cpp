// Forced clears of private pools: live blocks taken from their owners, and
// the tombstones that keep their owners' late frees from freeing anything
// newer.
//
// A tombstone is the first min_block bytes of a block taken back, left in
// state invalidated at the block's address: it stays in the sub-pool's
// index (so a late free finds it) and outside the free
// bins (so nothing merges with it and no newer block starts at its
// address); the rest of the block is free again. Per sub-pool:
//   counters.invalidated       = #{tombstones},
//   counters.invalidated_bytes = min_block * #{tombstones}.
// The late free removes the tombstone (the memory joins its free
// neighbours). The trace shows a taken block's free_requested and
// free_completed at the clear, then the tombstone as an alloc of min_block
// bytes at its address, freed (free_requested, free_completed) by the late
// free, an orphan's included; destroying the pool drops the tombstones with its segments,
// and a late free after that is an unknown pointer like any other.
//
// A forced clear runs in two phases under the sub-pool's lock (all of a
// pool's sub-pools' locks for a destroy): prepare_take_back checks and
// reserves everything and may throw, changing nothing; then
// take_back_live_blocks and the layout's reset change the pool and throw
// nothing, so a failure never leaves half the blocks taken.
#include <string>

#include "alloc/allocator_core.h"
#include "alloc/block_structure.h"
#include "alloc/core_util.h"
#include "alloc/size_policy.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

namespace {

void refuse_held_outside(const block_pool& part, const char* op) {
  std::size_t shared = 0;
  std::string named;
  for (const auto& s : part.segments) {
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->state != block_state::allocated || !b->held_outside) continue;
      if (++shared <= 8) named += (shared > 1 ? ", " : "") + hex(b->address) + " (" + std::to_string(b->size) + " bytes)";
    }
  }
  if (shared == 0) return;
  throw invalid_argument(std::string(op) + ": sub-pool '" + part.part_name + "' has " + std::to_string(shared) +
                         " block(s) shared with another process: " + named + (shared > 8 ? ", ..." : "") +
                         "; another process may still use them, so a forced clear does not take them back and "
                         "nothing was taken. Let every holder release them, then retry");
}

}  // namespace

void prepare_take_back(const block_pool& part, const char* op, invalidated_blocks_report& taken) {
  refuse_held_outside(part, op);
  std::size_t live = 0;
  for (const auto& s : part.segments) {
    for (const block* b = s->first; b != nullptr; b = b->next) live += b->state == block_state::allocated ? 1 : 0;
  }
  taken.blocks.reserve(taken.blocks.size() + live);
}

void allocator_core::take_back_live_blocks(block_pool& part, invalidated_blocks_report& taken) {
  auto& c = part.counters;
  // Every pending free has passed: the device was synchronized after it.
  // Private pools never share a wait (awaiting_frees.h is pinned memory's).
  for (block* b : part.pending) {
    for (auto e : b->waits) events_.give_back(e);
    b->waits.clear();
    pool_counters::sub(c.active, 1);
    pool_counters::sub(c.active_bytes, static_cast<std::int64_t>(b->size));
    pool_counters::sub(c.requested_bytes, static_cast<std::int64_t>(b->requested));
    b->requested = 0;
    b->state = block_state::free;
    if (trace_.enabled()) trace_.note(trace_action::free_completed, b->address, b->size, b->stream);
    note_free_wait({free_wait_event::action::completed, b->address, b->size, b->stream});
    (void)part.by_address.take(b->address);
    part.bins.insert(b);  // unmerged: the layout is reset next
  }
  part.pending.clear();
  for (auto& s : part.segments) {
    for (block* b = s->first; b != nullptr; b = b->next) {
      if (b->state != block_state::allocated) continue;
      taken.blocks.push_back({b->address, b->size});  // room reserved by prepare_take_back
      taken.bytes += b->size;
      pool_counters::sub(c.allocations, 1);
      pool_counters::sub(c.allocated_bytes, static_cast<std::int64_t>(b->size));
      pool_counters::sub(c.requested_bytes, static_cast<std::int64_t>(b->requested));
      pool_counters::sub(c.active, 1);
      pool_counters::sub(c.active_bytes, static_cast<std::int64_t>(b->size));
      // Traced as the block's free, done at once, and the tombstone's alloc,
      // which its removal frees: each alloc in the trace has one free.
      if (trace_.enabled()) {
        trace_.note(trace_action::free_requested, b->address, b->size, b->stream);
        trace_.note(trace_action::free_completed, b->address, b->size, b->stream);
        trace_.note(trace_action::alloc, b->address, min_block, b->stream);
      }
      // Cut to a tombstone; the layout's reset frees the rest of it.
      b->state = block_state::invalidated;
      b->size = min_block;
      b->requested = 0;
      let_used_on_go(b);  // nothing waits for them now (record_stream skips tombstones)
      b->claimed = false;  // the tombstone has no owner's claim; its late free is still accepted
      pool_counters::add(c.invalidated, 1);
      pool_counters::add(c.invalidated_bytes, static_cast<std::int64_t>(min_block));
    }
  }
}

void allocator_core::remove_tombstone(block_pool& part, block* b, backend::stream_ref stream) {
  // Its owner's work on `stream` may still touch it: a hand-out on another
  // stream waits for that first, as for any free block of a private pool.
  // Stream pools keep no last streams: their tombstones lie in segments the
  // device gave out after the owner's memory left, which nothing of the
  // owner's touches. (A growing private pool's may be either kind: waited for.)
  make_room_to_settle(b, 1);  // the steps that may throw: first
  if (part.is_private) {
    held_streams_.hold(stream);  // a hand-out on another stream will wait for it
    add_unique(b->last_streams, stream);
  }
  pool_counters::sub(part.counters.invalidated, 1);
  pool_counters::sub(part.counters.invalidated_bytes, static_cast<std::int64_t>(b->size));
  ++part.frees;
  b->state = block_state::free;
  note_tombstone_removed(b->address, stream);
  (void)part.by_address.take(b->address);
  settle(part, b);
}

void allocator_core::note_tombstone_removed(std::uintptr_t address, backend::stream_ref stream) {
  if (!trace_.enabled()) return;
  trace_.note(trace_action::free_requested, address, min_block, stream);
  trace_.note(trace_action::free_completed, address, min_block, stream);
}

}  // namespace shoal::alloc::detail
