// Small value types of the device interface: which backend, and the opaque
// references to streams, events, imported event sources and physical memory
// chunks a device hands out.
//
// References are plain values, safe to copy between threads. They are only
// meaningful to the device that created them; using one after it was
// destroyed gives shoal::invalid_argument.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <string_view>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::backend {

enum class device_kind : std::uint8_t { host = 1, cuda = 2 };

[[nodiscard]] constexpr std::string_view to_string(device_kind kind) noexcept {
  return kind == device_kind::host ? "host" : "cuda";
}

/// A stream: an in-order queue of device work. The null reference is the
/// device's default stream.
struct stream_ref {
  void* native = nullptr;
  [[nodiscard]] bool is_default() const noexcept { return native == nullptr; }
  friend auto operator<=>(const stream_ref&, const stream_ref&) = default;
};

/// An event: a marker recorded into a stream, complete once the stream has
/// passed it. An event never recorded counts as complete.
struct event_ref {
  void* native = nullptr;
  friend auto operator<=>(const event_ref&, const event_ref&) = default;
};

/// An event source another process exported, opened by
/// device::open_event_source; valid until close_event_source.
struct imported_event_ref {
  void* native = nullptr;
  friend auto operator<=>(const imported_event_ref&, const imported_event_ref&) = default;
};

/// A chunk of physical device memory that can be mapped into a reserved
/// address range (and exported by fd).
struct physical_ref {
  std::uint64_t native = 0;
  friend auto operator<=>(const physical_ref&, const physical_ref&) = default;
};

/// A physical chunk and the size it was created with (device::map_chunks).
struct sized_chunk {
  physical_ref chunk;
  std::size_t bytes = 0;
};

/// What a mapping of imported memory allows (device::import_memory).
enum class memory_access : std::uint8_t {
  read_write = 1,
  read_only = 2,  ///< reads only: a write through the mapping faults
};

/// What a device's growable ranges (reserve_range, create_physical, map)
/// can do: device::growable(), fixed for the device's life.
struct growable_support {
  /// The device has growable ranges. Where false, reserve_range and
  /// create_physical throw shoal::backend_error (CUDA: the device or driver
  /// has no virtual memory management), and the caching allocator serves
  /// expandable_segments with plain segments instead.
  bool supported = false;
  /// Mapped chunks can be exported to other processes (export_memory; CUDA:
  /// as POSIX file descriptors). Where false but supported is true, growable
  /// ranges work inside the process and export_memory of a pointer in a
  /// chunk throws shoal::backend_error; plain segments export as before.
  bool shareable = false;
  friend bool operator==(const growable_support&, const growable_support&) = default;
};

/// Device memory as the device itself reports it.
struct memory_info {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

}  // namespace shoal::backend

#pragma GCC visibility pop
