// Sharing storages between processes, with crash-safe reference counting.
//
// A `sharing_context` belongs to one allocator and holds what the producer
// side needs: counter files, the limbo, exported segments, and a background
// collector. A `peer` is one connection to another process; both processes
// may send and receive on it.
//
// Sending a storage hands its memory to a sent-data owner (the storage stays
// usable; see storage::hand_over) and takes one reference-counter slot held
// by the receiving process. The receiver's storage is a view of the
// producer's memory, mapped once per segment and cached; dropping it
// releases the slot once the stream it was received on, and every stream it
// was used on since (see storage.h), have passed their uses. When the
// producer drops its last handle while slots are still held, the block waits
// in the limbo; it is freed, on the stream the producer dropped it on, when
// every slot is released: checked when a shared block is released, when the
// allocator misses its cache, on collect(), and every collect_interval.
//
// Crash safety: the producer records each reference's holder (pid and
// process start time). When a holder dies, SIGKILL included, the collector
// reclaims its slots within collect_interval. When the producer dies first,
// consumers keep the memory until they drop it (tested on the host backend,
// and for plain segments on CUDA with driver 580; see docs/architecture.md).
// Counter memory is an anonymous memfd sealed against resizing, so no file
// outlives its processes and no process can truncate it under another.
//
// Trust model. A peer is admitted by the channel (its uid allowed by the
// access policy; a socket path in a 0700 directory) and is still untrusted.
// What follows holds between processes of different uids; a peer of the
// same uid can reach a producer's descriptors and memory through /proc or
// ptrace, which no protocol can stop:
//   - A consumer can hold the references it was sent (pinning that memory
//     until it releases them or dies) and give them up; nothing else. Each
//     holder process's references are counted in counter memory of its own,
//     and the producer trusts nothing a holder writes there beyond "this
//     reference is released", so a consumer cannot release another's
//     references, truncate counter memory, or stop the producer serving
//     others. Malformed frames, messages or descriptors close that
//     connection only (protocol_error).
//   - Sharing exports whole segments: a consumer sent a storage can map,
//     read and write the whole segment the storage lies in — a 2 MiB segment
//     of the small pool, a 20 MiB or larger one of the large pool, the
//     chunks of a growable segment it spans (up to 24 MiB each, up to 128 MiB
//     for those mapped before the segment first gave memory back), a whole
//     cudaMalloc allocation on CUDA —
//     including other blocks the allocator carved from it. Share only with
//     processes trusted with that memory, or allocate shared storages from an
//     allocator (or private pool) of their own.
//   - A producer can write the memory it shared at any time (by design) and
//     can make a consumer's receive stream wait for a point it never passes:
//     on the host backend the wait ends with stream_error when the exporter
//     dies (an event page must name the connection's peer as its exporter,
//     or it is refused); on CUDA a live producer can stall it. It cannot make a consumer
//     map or touch memory beyond what it sent (every range is checked
//     against what was mapped), truncate what it sent (segments and counter
//     memory are sealed memfds on the host backend), or exhaust the
//     consumer's descriptors or address space past sharing_options::max_peer_*
//     (each producer process apart: the access policy bounds how many).
//     On the host backend a segment's pages are shared memory of the
//     producer's file: a page it never wrote (a sparse file, or a hole it
//     punched later) is allocated when the consumer first reads it, and
//     counts in the consumer's memory cgroup for as long as the producer
//     keeps the file, up to the storage's size (within max_peer_mapped_bytes).
//   - Waits on a peer: receive() blocks until a message or the peer's end;
//     receive_for() has a deadline, sends have sharing_options::send_timeout,
//     and tearing a peer down waits at most sharing_options::teardown_timeout
//     (a peer that stalls in the middle of a message is cut off).
//   - A producer can stop serving a misbehaving consumer (peer::revoke) but
//     not take back what it holds: that memory stays pinned, never reused,
//     until the consumer releases it or dies. sharing_context::holders()
//     says which process pins how much. Revocation refuses that process
//     only: a new or forked process of the same uid may connect again;
//     only the access policy (allowed uids) keeps a user out.
//   - Errors a peer causes (protocol_error, connection_closed) name it:
//     their message starts with "peer pid <pid> (uid <uid>): ".
//   - References belong to the process that connected: one that forks after
//     receiving does not make its child a holder, and once it exits its
//     references are reclaimed even if the child still maps the memory (the
//     child must not use received memory past its parent's life). Nothing a
//     forked child does moves counter memory: its drops of inherited
//     storages release nothing, so they cannot free what its parent still
//     uses. A context, its peers and received storages are for the process
//     that made them.
//
// Ordering: the producer's writes enqueued before send() on the send stream
// are passed before any work the receiver enqueues on its receive stream.
//
// Forwarding: a received storage cannot be sent on (invalid_argument):
// copy it into a storage of this process and send the copy.
//
// Thread-safety: sharing_context's members may be called from any thread.
// A peer's send may be called from several threads at once; receive from
// one thread at a time. Storages sent or received follow storage's rules.
// The allocator must outlive the context, and the context every peer.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/channel/channel.h"
#include "shoal/ipc/sharing_types.h"
#include "shoal/storage/storage.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::ipc {

namespace detail {
class __attribute__((visibility("hidden"))) producer_state;  // hidden: the library's own
class __attribute__((visibility("hidden"))) peer_link;
}  // namespace detail

class sharing_context {
 public:
  explicit sharing_context(alloc::caching_allocator& allocator, sharing_options options = {});
  /// Stops the collector and collects once more. Blocks still in the limbo
  /// then stay allocated (other processes hold them) until the allocator goes.
  ~sharing_context();
  sharing_context(const sharing_context&) = delete;
  sharing_context& operator=(const sharing_context&) = delete;

  [[nodiscard]] alloc::caching_allocator& allocator() const noexcept;
  /// Reclaims dead holders' slots and frees every limbo block with no slot
  /// held; returns how many blocks it freed.
  std::size_t collect();
  [[nodiscard]] sharing_stats stats() const;
  /// Per process: the references it holds on this context's memory, the
  /// bytes they pin and the limbo blocks only it keeps; every process this
  /// context is connected to, holds memory of, or revoked, in pid order.
  [[nodiscard]] std::vector<holder_stats> holders() const;

 private:
  friend class peer;
  std::shared_ptr<detail::producer_state> state_;
  class __attribute__((visibility("hidden"))) collector;  // hidden: the library's own
  std::unique_ptr<collector> collector_;
};

class peer {
 public:
  /// Shares over `link`, an authenticated connection (see channel.h).
  peer(sharing_context& context, channel::connection link);
  /// Releases the references of storage messages that arrived but were
  /// never received, then closes the connection. Cached mappings close once
  /// no received storage uses them. Waits on the other process for at most
  /// sharing_options::teardown_timeout (twice, when this was the last peer
  /// of that producer): a peer that stalls mid-message is cut off, and a
  /// mapping whose release still waits for a ready point the producer has
  /// not passed stays open, with that producer's event sources, until the
  /// release has run (the context's collector then closes them). Meanwhile
  /// they count in the context's limits and, for that producer's next
  /// connections, in its own (max_peer_segments, max_peer_mapped_bytes).
  ~peer();
  peer(const peer&) = delete;
  peer& operator=(const peer&) = delete;

  /// Shares `storage` (memory of the context's allocator, not itself
  /// received from another process) with `metadata` attached; the receiver
  /// waits for what was enqueued on `stream` so far.
  void send(const storage::storage& storage, std::span<const std::byte> metadata, backend::stream_ref stream);
  /// send on the calling thread's current stream.
  void send(const storage::storage& storage, std::span<const std::byte> metadata = {});
  /// Sends metadata alone.
  void send_note(std::span<const std::byte> metadata);
  // Sends wait at most sharing_options::send_timeout for a peer that does not
  // read, then throw timeout_error; the connection is closed unless nothing
  // of that send had gone.
  /// Blocks for the next storage or note. The storage is ready for work
  /// enqueued on `stream`. Throws connection_closed when the peer has gone,
  /// protocol_error on a malformed message (the connection is closed then).
  /// It polls for sharing_options::receive_spin before it sleeps; the first
  /// receive after a send that brought the peer memory to map polls first
  /// until import_answer_spin after that send (sharing_types.h).
  received receive(backend::stream_ref stream);
  received receive();
  /// receive(), but gives up after `timeout` with timeout_error. The
  /// connection stays usable when the next batch had not begun to arrive
  /// (announcements read before it are kept); a peer that stalls in the
  /// middle of one has the connection closed (connection::receive_for).
  received receive_for(std::chrono::milliseconds timeout, backend::stream_ref stream);
  received receive_for(std::chrono::milliseconds timeout);
  /// The next storage or note if it has come whole, without waiting;
  /// nullopt when it has not (what came of it is kept for the next call).
  /// For a reader that polls native_handle(): once it is readable, call
  /// this until it returns nullopt. Throws as receive() does.
  std::optional<received> try_receive(backend::stream_ref stream);
  std::optional<received> try_receive();
  /// try_receive(), but when nothing whole has come it polls the peer's
  /// ring for up to `spin` first (connection::try_receive(spin)): for a
  /// reader that waits on native_handle() in slices of its own. After a
  /// send that brought the peer memory to map it may poll longer, until
  /// sharing_options::import_answer_spin after that send (at most a second).
  std::optional<received> try_receive(backend::stream_ref stream, std::chrono::nanoseconds spin);
  /// Reads the peer's protocol hello if it has come and was not read yet,
  /// without waiting and never past it: protocol_error naming both
  /// protocols when the other end is an endpoint of another protocol (a
  /// lender greets as it accepts). How a peer that only sends finds out it
  /// reached the wrong endpoint. Call it where receives are made, not beside one.
  void check_greeting();
  /// Waits until the other process has taken every storage sent on this
  /// connection — received it (its memory mapped there: from then on it
  /// outlives this process, on every backend) or let it go — for at most
  /// `timeout` (zero: looks once). peer_gone when it hung up first, or this
  /// connection was shut down (revoke), with some neither received nor let
  /// go (a holder's references are reclaimed once its process is gone). A
  /// process that ends before a consumer took its storages loses them: one
  /// gone before its connection was accepted cannot even be identified (the
  /// consumer refuses it), and on CUDA memory not yet mapped elsewhere goes
  /// with it. Taken is not run: a producer that ends must also let the work
  /// it enqueued before each send finish (synchronize those streams), or the
  /// consumer's wait for it fails. Notes are not waited for. What the other
  /// process writes in its counter memory only ends this wait sooner or
  /// later, never decides what is freed. Any thread; polls the counters in
  /// pauses growing to 2 ms, and the socket for a hang-up. With `at_most`,
  /// all_taken comes once no more than that many are untaken (a producer
  /// keeping a bounded number of batches ahead of its consumer).
  [[nodiscard]] taken_state wait_taken(std::chrono::milliseconds timeout, std::size_t at_most = 0);
  /// Storages sent on this connection that the other process has neither
  /// received nor let go yet. Any thread.
  [[nodiscard]] std::size_t untaken();
  /// Not zero while frames that came wait to be taken — in a batch already
  /// read or in the peer's ring (channel::connection::pending): then
  /// try_receive() may return more though native_handle() is not readable
  /// (it stops after one batch's worth of announcements). Any thread.
  [[nodiscard]] std::size_t pending() const;

  /// Stops trusting the peer process: closes this connection (a receive or
  /// send blocked on it, here or in the peer, ends with connection_closed;
  /// later ones throw it) and the context sends that process nothing more,
  /// on any connection (peer_refused). The references it holds stay held:
  /// it still maps that memory, and no process can unmap another's, so the
  /// memory is not reused until it releases them or dies (then the
  /// collector reclaims them as for any holder). Revocation is by process
  /// (pid and start time), not by user: the same user can start or fork a
  /// new process and connect again. To keep a user out, leave its uid out of
  /// the listener's channel::access_policy (and the socket's directory).
  /// May be called from any thread, more than once.
  void revoke();

  [[nodiscard]] const channel::peer_credentials& credentials() const noexcept;
  [[nodiscard]] peer_stats stats() const;
  /// The connection's socket, for poll(): readable when a message, or its
  /// start, waits that try_receive() has not taken. Messages travel through
  /// a shared ring (sharing_options::ring_bytes) and a wake-up on the socket
  /// says they came, so one wake-up may stand for several messages, or for
  /// one a spinning receive already took: once it is readable, call
  /// try_receive() until it returns nullopt, rather than one blocking
  /// receive().
  [[nodiscard]] int native_handle() const noexcept;

 private:
  std::shared_ptr<detail::peer_link> link_;
};

}  // namespace shoal::ipc

#pragma GCC visibility pop
