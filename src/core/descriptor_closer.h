// The closer: closes descriptors whose close may block for as long as a
// peer process likes (see unique_fd::from_peer), so that the thread that
// drops one goes on at once.
//
// Up to max_closer_threads threads per process, the first started at the
// first hand-over, another whenever a hand-over finds more descriptors
// waiting than threads free (a close that does not return holds one thread,
// not the ones behind it);
// then asleep when they have nothing to close. Before each close a socket's
// linger is turned off, so the plain lingering socket closes at once; a peer
// can still hold a close (a unix socket whose own queue holds a lingering
// socket, a linger turned on again from the peer's copy, a FUSE file's flush
// its daemon never answers). While every thread is held, descriptors wait
// in the queue, open, counted in the process's descriptor table: once more
// wait than closer_backlog_limit() and no close has returned for 100 ms,
// closer_backlogged() says so, and the channel starts no new batch from
// peers that may send descriptors (they would come on top) until the
// closers catch up. In a fork() child the parent's queue is left as
// it was (its descriptors are close-on-exec); the child starts its own
// closers at its first hand-over.
//
// Thread-safety: every function may be called from any thread at once.
// Internal (not installed).
#pragma once

#include <chrono>
#include <cstddef>

namespace shoal::detail {

inline constexpr std::size_t max_closer_threads = 4;

/// Hands `fd` to the closer threads, which close it; closes it here if no
/// thread can be started at all (out of memory or threads).
void close_off_thread(int fd) noexcept;

/// How many descriptors may wait to be closed before backlogged() says so:
/// a quarter of the process's soft descriptor limit, at most 4096.
[[nodiscard]] std::size_t closer_backlog_limit() noexcept;

/// Whether more descriptors wait than closer_backlog_limit() and no close
/// has returned for 100 ms. One relaxed load while there is no such queue:
/// read before each batch from a peer.
[[nodiscard]] bool closer_backlogged() noexcept;

/// Waits until every descriptor handed over before the call is closed, at
/// most `timeout`; whether they all were.
[[nodiscard]] bool off_thread_closes_done_within(std::chrono::nanoseconds timeout);

}  // namespace shoal::detail
