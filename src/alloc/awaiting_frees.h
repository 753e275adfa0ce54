// Pinned host frees that share one event (the pinned pair's cost).
//
// A pinned block freed on its pool's own stream must not be handed out
// again until that stream has passed the free, as seen from the host.
// Recording an event per free costs about as much as a small copy, so such
// frees first wait "awaiting" (state pending_free, in the pending list, no
// event yet); once 1 MiB or 16 of them have gathered, or an allocation on
// the stream finds no free block, one event recorded on the stream covers
// them all ("sealing"). An event recorded later on the same stream completes
// no earlier than one recorded at each free would have, so the hold is never
// shorter; it is longer by the work queued on the stream between the free
// and the seal. The group's event is shared: each block lists it in its
// waits (wait_shared set), and it goes back to the event pool with the last.
//
// Only calls made on the pool's own stream seal (a free, an allocation that
// misses, the host wait of one at the limit); empty_cache and
// process_pending_frees treat awaiting frees as not passed yet. So a stream
// that goes idle leaves at most 1 MiB (16 blocks) of its pool held until its
// next call; a stream destroyed by its owner makes no more calls, so the
// allocator seals its awaiting frees when it lets the stream go
// (destroyed_streams.cpp; the stream is still held then). (The rule dates
// from when a stream could be destroyed before the allocator, and recording
// on it then was undefined; every pool's stream is held now,
// pool_directory.h, so empty_cache and process_pending_frees could seal
// too.)
//
// Invariant (checked): a pool's awaiting blocks are exactly its pending
// blocks with an empty wait list, and its sealed groups' holder counts add
// up to its pending blocks sharing an event.
// Thread-safety: under the pool's lock.
#pragma once

#include <cstddef>

#include "alloc/block_pool.h"
#include "alloc/event_pool.h"
#include "shoal/backend/device.h"
#include "shoal/core/error.h"

namespace shoal::alloc::detail {

/// Free bytes / blocks gathered on a pool's stream before one event covers them.
inline constexpr std::size_t seal_bytes = std::size_t{1} << 20;
inline constexpr std::size_t seal_blocks = 16;

/// Makes room for one more awaiting block, so that await_free cannot throw;
/// throws std::bad_alloc and changes nothing when the host has none.
void make_room_to_await(block_pool& pool);
/// Adds a block just freed on the pool's stream (state pending_free, in
/// pool.pending, no waits; make_room_to_await called before); seals when
/// enough have gathered. A seal that fails (the device, or the host's
/// memory) is left for the next seal to report: the blocks stay awaiting, so
/// none is handed out. Throws nothing.
void await_free(block_pool& pool, block* b, backend::device& device, event_pool& events) noexcept;
/// One event on the pool's stream for every awaiting block. Throws the
/// device's error and changes nothing when the record fails.
void seal_awaiting(block_pool& pool, backend::device& device, event_pool& events);
/// Drops one holder of a shared wait (make_reusable, teardown); the event
/// goes back with the last.
void release_shared_wait(block_pool& pool, backend::event_ref event, event_pool& events) noexcept;

}  // namespace shoal::alloc::detail
