// The closer: closes descriptors whose close may block for as long as a
// peer process likes (see unique_fd::from_peer), so that the thread that
// drops one goes on at once.
//
// Each descriptor is handed over with its owner: the uid of the peer that
// passed it (or is at its other end: a listener's waiting connections are
// each charged to its own), unknown_owner when no one peer is known. Each
// owner's descriptors are
// closed in the order they came, by at most max_closes_per_owner threads at
// once, owners taking turns; a thread is started whenever an owner with
// work finds none free, up to max_closer_threads per process, and sleeps
// when it has nothing to close. So a peer that holds its closes (a unix
// socket whose own queue holds a lingering socket, a linger turned on again
// from the peer's copy, a FUSE file's flush its daemon never answers) holds
// at most max_closes_per_owner threads, and the other peers' descriptors are
// closed by others. Before each close a socket's linger is turned off, so
// the plain lingering socket closes at once.
//
// Held descriptors wait in their owner's queue, open, counted in the
// process's descriptor table. Once an owner has more waiting than
// closer_owner_backlog_limit() and none of its closes has returned for
// 100 ms, or more than twice that whatever returns, closer_backlogged(owner)
// says so, and the channel starts no new
// batch from that owner's connections that may send descriptors (they would
// come on top) until its closes catch up; its queue is bounded so. The
// process-wide limit, closer_backlog_limit(), counts the descriptors of
// owners within their own limit: past it, with no close returned for 100 ms
// anywhere, every owner's new batches wait (many owners, each within its
// limit, filling the table). In a fork() child the parent's queue is left as
// it was (its descriptors are close-on-exec; the child may have closed their
// numbers and opened its own files there, which closing them would close);
// the child starts its own closers at its first hand-over.
//
// Thread-safety: every function may be called from any thread at once.
// Internal (not installed).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace shoal::detail {

/// Whose descriptors a hand-over brings: a peer's uid.
using closer_owner = std::uint32_t;
/// No one peer known; (uid_t)-1, which no process runs as.
inline constexpr closer_owner unknown_owner = UINT32_MAX;

/// Threads one owner's closes may hold at once.
inline constexpr std::size_t max_closes_per_owner = 2;
/// Threads per process.
inline constexpr std::size_t max_closer_threads = 32;

/// Hands `fd`, `owner`'s, to the closer threads, which close it; closes it
/// here if no thread can be started at all (out of memory or threads).
void close_off_thread(int fd, closer_owner owner = unknown_owner) noexcept;

/// How many descriptors of owners within their own limit may wait to be
/// closed before closer_backlogged() says so for everyone: a quarter of the
/// process's soft descriptor limit, from 16 to 4096.
[[nodiscard]] std::size_t closer_backlog_limit() noexcept;
/// How many of one owner's descriptors may wait before closer_backlogged()
/// says so for that owner: a quarter of closer_backlog_limit(), at least 4.
[[nodiscard]] std::size_t closer_owner_backlog_limit() noexcept;

/// Whether `owner`'s connections should begin no batch that may bring
/// descriptors: more of its descriptors wait than its limit and none of its
/// closes has returned for 100 ms, or more than twice its limit wait (closes
/// returned now and then do not let a queue grow without end), or the
/// process-wide limit is passed and no close has returned for 100 ms. One
/// relaxed load while no queue is over a limit: read before each batch from
/// a peer.
[[nodiscard]] bool closer_backlogged(closer_owner owner) noexcept;

/// Whether listeners should accept no connection for now: more than twice
/// closer_backlog_limit() descriptors wait, of every owner together, however
/// often a close returns. A connection refused at its accept may have
/// descriptors queued, which go to the closers with it: peers of uids no
/// listener admits (an abstract name) could otherwise fill the descriptor
/// table by connecting again and again. One relaxed load.
[[nodiscard]] bool closer_holds_accepts() noexcept;

/// Waits until every descriptor handed over before the call is closed, at
/// most `timeout`; whether they all were.
[[nodiscard]] bool off_thread_closes_done_within(std::chrono::nanoseconds timeout);

}  // namespace shoal::detail
