// Pinned host frees that share one event (the pinned pair's cost).
//
// A pinned block freed on its pool's own stream must not be handed out
// again until that stream has passed the free, as seen from the host.
// Recording an event per free costs about as much as a small copy, so such
// frees first wait "awaiting" (state pending_free, in the pending list, no
// event yet); once enough bytes or blocks have gathered — or as soon as
// anything looks at pending frees — one event recorded on the stream covers
// them all ("sealing"). An event recorded later on the same stream completes
// no earlier than one recorded at each free would have: a conservative
// stand-in, so the hold is never shorter. The group's event is shared: each
// block lists it in its waits (wait_shared set), and it goes back to the
// event pool with the last of them.
//
// Invariant: a pool's awaiting blocks are exactly its pending blocks with an
// empty wait list; every reader of pending frees' waits seals first.
// Thread-safety: under the pool's lock.
#pragma once

#include <cstddef>

#include "alloc/block_pool.h"
#include "alloc/event_pool.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

/// Free bytes / blocks gathered on a pool's stream before one event covers them.
inline constexpr std::size_t seal_bytes = std::size_t{1} << 20;
inline constexpr std::size_t seal_blocks = 16;

/// Adds a block just freed (state pending_free, in pool.pending, no waits);
/// seals when enough have gathered. A failure to record is left for the
/// next seal to report: the block stays awaiting, so it is never handed out.
void await_free(block_pool& pool, block* b, backend::device& device, event_pool& events) noexcept;
/// One event on the pool's stream for every awaiting block. Throws the
/// device's error and changes nothing when the record fails.
void seal_awaiting(block_pool& pool, backend::device& device, event_pool& events);
/// Drops one holder of a shared wait (make_reusable, teardown); the event
/// goes back with the last.
void release_shared_wait(block_pool& pool, backend::event_ref event, event_pool& events) noexcept;

}  // namespace shoal::alloc::detail
