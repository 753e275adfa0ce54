// The bytes a connection has taken to send and the socket has not taken
// yet: what connection::post queues for a peer that does not read as fast
// as it is sent to, written out in order as the socket takes them.
//
// Each entry is what the socket did not take of one batch (frame_batch.h):
// the whole batch, or the rest of one the socket took in part when it was
// posted, with copies of the descriptors that have not gone yet. They go with
// the entry's first byte written: an entry keeps them until that byte is
// written, and drops them after (closed off the dropping thread, as a
// peer's descriptors are). Each entry remembers when it was posted.
// Invariants:
//   bytes() = sum over the entries of (batch.size() - written);
//   only the front entry may have written > 0, and an entry with
//   written > 0 holds no descriptors (they went with its first byte);
//   bytes() == 0 exactly when there are no entries;
//   oldest_post() = the front entry's posted (entries are in post order).
// They hold when an operation throws too (a failed allocation included):
// an entry is counted only once it is in the queue.
//
// Not thread-safe: the connection serializes it under its send lock.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "channel/frame_batch.h"
#include "shoal/core/unique_fd.h"

namespace shoal::channel::detail {

class send_queue {
 public:
  /// Sends the encoded batch `batch` with `descriptors` without waiting:
  /// written at once when nothing is queued, as far as the socket takes
  /// it; the rest (or all of it, behind what is queued) is queued with
  /// copies of the descriptors that have not gone. Throws as write_ready
  /// does (the stream may then be out of step), backend_error when a
  /// descriptor cannot be copied.
  void post(int socket, std::span<const std::byte> batch, std::span<const int> descriptors);

  /// Writes queued bytes, in order, until the socket takes no more or none
  /// are left, without waiting. Throws as write_ready does.
  void flush(int socket);

  /// flush() until nothing is queued, waiting for room in the socket until
  /// `until` (nullopt: without a deadline); false when `until` passed first
  /// (what went stays gone, the rest stays queued).
  [[nodiscard]] bool drain(int socket, deadline until);

  /// Bytes queued and not yet written.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// When the oldest entry still queued was posted; nullopt when none is.
  [[nodiscard]] std::optional<std::chrono::steady_clock::time_point> oldest_post() const noexcept;

 private:
  struct entry {
    std::vector<std::byte> batch;
    std::size_t written = 0;
    std::vector<unique_fd> descriptors;  // empty once written > 0
    std::chrono::steady_clock::time_point posted;
  };

  // Queues the part of `batch` from `written` on.
  void queue(std::span<const std::byte> batch, std::size_t written, std::span<const int> descriptors);

  std::deque<entry> entries_;
  std::size_t bytes_ = 0;
};

}  // namespace shoal::channel::detail
