// Batches of frames on a connected UNIX stream socket: the wire form under
// connection (include/shoal/channel/channel.h documents the layout).
//
// A batch goes out in one sendmsg with the descriptors of its frames, and is
// padded to min_batch_bytes so that the receiver reads it whole with one
// recvmsg of that size when it is that small, and never past its end: after a
// batch is read, the socket is readable exactly when another one waits, and
// the descriptors of one read belong to one batch.
//
// Not thread-safe: the caller serializes sends, and reads, per socket.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "shoal/channel/channel.h"
#include "shoal/core/error.h"

namespace shoal::channel::detail {

/// When a wait on the socket gives up; nullopt: never.
using deadline = std::optional<std::chrono::steady_clock::time_point>;

/// The deadline passed after part of a batch had been read or sent: the
/// stream is out of step. (A plain timeout_error: nothing of it had moved.)
class timeout_mid_batch : public timeout_error {
 public:
  using timeout_error::timeout_error;
};

/// The peer takes no descriptors (SO_PASSRIGHTS off at its end, Linux 6.16
/// on: connection::refuse_descriptors, or an endpoint of a protocol that
/// passes none) and the batch brought one: nothing of it went.
class descriptors_refused : public protocol_error {
 public:
  using protocol_error::protocol_error;
};

/// How many of `frames`, from the first, the next batch holds: at least one,
/// and as many more as fit max_batch_frames, max_batch_descriptors and
/// batch_packing_bytes of payload.
[[nodiscard]] std::size_t frames_in_next_batch(std::span<const outgoing_frame> frames) noexcept;

/// Writes the wire form of `frames` as one batch into `out` (replacing what
/// it held) and returns their descriptors, in order. invalid_argument when
/// they do not fit one batch (frames_in_next_batch says how many do).
[[nodiscard]] std::vector<int> encode_batch(std::span<const outgoing_frame> frames, std::vector<std::byte>& out);

/// One write of `bytes` that never waits, with `descriptors` going with its
/// first byte: how many bytes the socket took, 0 when it is full (and then
/// the descriptors did not go either). Throws connection_closed when the
/// peer is gone, descriptors_refused when it takes no descriptors,
/// backend_error otherwise.
[[nodiscard]] std::size_t write_ready(int socket, std::span<const std::byte> bytes, std::span<const int> descriptors);

/// Writes the wire form of `frames` as one batch into `out` (replacing what
/// it held) and sends it with their descriptors, waiting for room in the
/// socket until `until`. Throws connection_closed when the peer is gone,
/// descriptors_refused (nothing went) when it takes no descriptors,
/// backend_error otherwise (part of the batch may have gone then);
/// timeout_error when `until` passed before any byte went, timeout_mid_batch
/// when it passed after some did.
void send_batch(int socket, std::span<const outgoing_frame> frames, std::vector<std::byte>& out, deadline until);

/// True when no byte waits to be read on `socket` (so no descriptor a peer
/// sent is queued on it either); false also when the kernel cannot say.
/// Asked without reading or peeking: a peek moves an SO_PEEK_OFF offset.
[[nodiscard]] bool nothing_queued_to_read(int socket) noexcept;

/// The largest batch body (what follows the batch header) a receiver whose
/// frames carry at most `max_payload` bytes accepts.
[[nodiscard]] std::size_t max_batch_body(std::size_t max_payload) noexcept;

/// The batch a receiver has begun to read and not read whole yet: its bytes
/// so far and the descriptors that came with them. Between batches it holds
/// nothing (got == 0); `bytes` is scratch space kept from batch to batch.
struct partial_batch {
  std::vector<std::byte> bytes;
  std::size_t got = 0;   // bytes of the batch read so far
  std::size_t size = 0;  // the whole batch's size once its header is read; 0 before
  std::vector<unique_fd> descriptors;
  /// Descriptors a batch may bring: max_batch_descriptors, or 0 for a peer
  /// that never sends one (connection::refuse_descriptors: its reads leave
  /// no room for any, so the kernel installs none); past it, the read
  /// throws protocol_error.
  std::size_t most_descriptors = max_batch_descriptors;
  /// The peer's uid: its descriptors are charged to it at the closer.
  std::uint32_t peer_uid = unique_fd::no_one_peer;

  [[nodiscard]] bool started() const noexcept { return got > 0; }
  /// Drops what was read (its descriptors, a peer's, go to the closer
  /// thread): nothing has begun.
  void clear() noexcept;
};

/// Reads the rest of the batch `partial` holds (the next one when it holds
/// none) and splits it into its frames, in order; `partial` holds nothing
/// after. Before anything has come it first tries without sleeping for up
/// to `spin`, then blocks until `until`. Throws protocol_error (without
/// naming the peer) when the batch is malformed, connection_closed at end of
/// stream, backend_error when the system refuses, timeout_error when `until`
/// passed before any byte came, timeout_mid_batch when it passed in the
/// middle of the batch (a peer that sent part of one and stalls); on every
/// error `partial` is cleared, closing the descriptors read.
[[nodiscard]] std::vector<frame> read_batch(int socket, std::size_t max_payload, std::chrono::nanoseconds spin,
                                            deadline until, partial_batch& partial);

/// read_batch without waiting: reads what the socket has now toward the
/// batch `partial` holds. Its frames once it is whole; nullopt when the
/// socket has no more of it yet (what came stays in `partial`, and a later
/// read_batch or read_batch_if_ready goes on from there). Throws as
/// read_batch does, never timeout_error.
[[nodiscard]] std::optional<std::vector<frame>> read_batch_if_ready(int socket, std::size_t max_payload,
                                                                    partial_batch& partial);

}  // namespace shoal::channel::detail
