// Points in a stream that another process can order its own streams after.
//
// The exporting process calls device::export_event(stream) and gets an
// event_point: a small value, sent as the bytes of serialize(). Points come
// from event sources: on the host backend one shared counter page per device
// (each stream publishes how far it has run in its own slot of the page), on
// CUDA one interprocess event per exporting stream. The importing process
// opens each source once, from the event_source that
// device::describe_event_source(point.source_id) gave the exporter: its bytes
// and, for kinds that carry one, a file descriptor sent alongside
// (SCM_RIGHTS). Then device::wait_imported(stream, source, point) orders its
// stream after the point.
//
// Both deserialize() functions validate every field, so malformed bytes from
// another process give shoal::protocol_error (an invalid_argument) saying
// which field is wrong, and nothing else; a descriptor that came with them
// is closed then.
//
// Not thread-safe (value types); an event_source owns its descriptor.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shoal/backend/types.h"
#include "shoal/core/unique_fd.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::backend {

/// A point in an exporting process's stream.
///
/// Host: passed once the counter in slot `stream_slot` of source `source_id`
/// reaches `ticket`; a slot's counter only grows, so a passed point stays
/// passed. CUDA: `stream_slot` and `ticket` are 0, and a wait on the point
/// waits for the most recent export_event on that stream at the time the
/// wait is enqueued, which is this point or a later one (CUDA re-records one
/// event per stream).
struct event_point {
  /// Bytes serialize() produces.
  static constexpr std::size_t wire_bytes = 4 + 2 + 4 + 8 + 8;

  std::uint64_t source_id = 0;    ///< which source it belongs to; never 0
  std::uint32_t stream_slot = 0;  ///< host: the exporting stream's slot in the page
  std::uint64_t ticket = 0;       ///< host: the counter value that passes it

  [[nodiscard]] std::vector<std::byte> serialize() const;
  /// Rebuilds a point from serialize()'s bytes. Throws shoal::protocol_error
  /// on malformed input.
  [[nodiscard]] static event_point deserialize(std::span<const std::byte> bytes);

  friend bool operator==(const event_point&, const event_point&) = default;
};

enum class event_source_kind : std::uint8_t {
  host_page = 1,       ///< host backend: a sealed memfd of per-stream counters
  cuda_ipc_event = 2,  ///< CUDA: a cudaIpcEventHandle_t in `opaque`
};

[[nodiscard]] constexpr bool carries_fd(event_source_kind kind) noexcept {
  return kind == event_source_kind::host_page;
}

/// What another process needs to open an event source once.
struct event_source {
  /// Bytes of the CUDA IPC event handle (cudaIpcEventHandle_t is 64 bytes).
  static constexpr std::size_t opaque_bytes = 64;
  /// Bytes serialize() produces.
  static constexpr std::size_t wire_bytes = 4 + 2 + 1 + 1 + 4 + 8 + opaque_bytes;

  event_source_kind kind = event_source_kind::host_page;
  device_kind device = device_kind::host;
  std::int32_t device_ordinal = 0;  ///< 0 for the host
  std::uint64_t source_id = 0;      ///< as in the points it describes; never 0
  std::array<std::byte, opaque_bytes> opaque{};  ///< cuda_ipc_event only; zero otherwise
  unique_fd fd;  ///< valid iff carries_fd(kind)

  /// The fixed-size wire form of everything but the descriptor.
  [[nodiscard]] std::vector<std::byte> serialize() const;
  /// Rebuilds a source from serialize()'s bytes and the descriptor received
  /// with them (-1 when none came). Throws shoal::protocol_error on malformed
  /// input; `fd` is closed then.
  [[nodiscard]] static event_source deserialize(std::span<const std::byte> bytes, unique_fd fd);
};

}  // namespace shoal::backend

#pragma GCC visibility pop
