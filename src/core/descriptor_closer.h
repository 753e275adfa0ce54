// The closer thread: closes descriptors whose close may block for as long as
// a peer process likes (see unique_fd::from_peer), so that the thread that
// drops one goes on at once.
//
// One thread per process, started at the first hand-over, then asleep when
// it has nothing to close. A descriptor waits in its queue until the closes
// before it are done: a peer that holds one close (a socket re-armed to
// linger, a FUSE daemon that never answers) holds the ones behind it open,
// counted in the process's descriptor table, but no thread of the caller's.
// Before each close it turns a socket's linger off, so a peer must re-arm it
// in that instant to hold the thread at all. In a fork() child the parent's
// queue is left as it was (its descriptors are close-on-exec); the child
// starts its own closer at its first hand-over.
//
// Thread-safety: both functions may be called from any thread at once.
// Internal (not installed).
#pragma once

#include <chrono>

namespace shoal::detail {

/// Hands `fd` to the closer thread, which closes it; closes it here if no
/// thread can be started (out of memory or threads).
void close_off_thread(int fd) noexcept;

/// Waits until every descriptor handed over before the call is closed, at
/// most `timeout`; whether they all were.
[[nodiscard]] bool off_thread_closes_done_within(std::chrono::nanoseconds timeout);

}  // namespace shoal::detail
