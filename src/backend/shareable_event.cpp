#include "shoal/backend/shareable_event.h"

#include <algorithm>
#include <string>

#include "core/wire.h"
#include "shoal/core/error.h"

namespace shoal::backend {

namespace {

using shoal::detail::wire_reader;
using shoal::detail::wire_writer;

// Wire layouts:
//   point:  u32 magic | u16 version | u32 stream_slot | u64 source_id | u64 ticket
//   source: u32 magic | u16 version | u8 kind | u8 device | i32 ordinal |
//           u64 source_id | 64 bytes opaque
constexpr std::uint32_t point_magic = 0x53484550;   // "SHEP"
constexpr std::uint32_t source_magic = 0x53484553;  // "SHES"
constexpr std::uint16_t wire_version = 1;

[[noreturn]] void malformed(const char* what, const std::string& why) {
  throw protocol_error(std::string("malformed ") + what + ": " + why +
                       "; the sender is not a matching shoal version or sent garbage");
}

/// Checks the record's length, magic and version; returns a reader past them.
wire_reader expect_header(std::span<const std::byte> bytes, std::size_t wire_bytes, std::uint32_t magic, const char* what) {
  if (bytes.size() != wire_bytes) {
    malformed(what, "expected " + std::to_string(wire_bytes) + " bytes, got " + std::to_string(bytes.size()));
  }
  wire_reader r(bytes, what);
  if (r.get<std::uint32_t>("magic") != magic) malformed(what, "bad magic number");
  if (const auto version = r.get<std::uint16_t>("version"); version != wire_version) {
    malformed(what, "wire version " + std::to_string(version) + ", this process speaks " + std::to_string(wire_version));
  }
  return r;
}

}  // namespace

std::vector<std::byte> event_point::serialize() const {
  wire_writer w(wire_bytes);
  w.put(point_magic).put(wire_version).put(stream_slot).put(source_id).put(ticket);
  return w.take();
}

event_point event_point::deserialize(std::span<const std::byte> bytes) {
  constexpr const char* what = "event point";
  auto r = expect_header(bytes, wire_bytes, point_magic, what);
  event_point p;
  p.stream_slot = r.get<std::uint32_t>("stream_slot");
  p.source_id = r.get<std::uint64_t>("source_id");
  p.ticket = r.get<std::uint64_t>("ticket");
  r.finish();
  if (p.source_id == 0) malformed(what, "source id 0");
  // Whether the slot exists and the ticket fits its kind is up to the
  // source the point is waited on: device::wait_imported checks them.
  return p;
}

std::vector<std::byte> event_source::serialize() const {
  wire_writer w(wire_bytes);
  w.put(source_magic).put(wire_version).put(static_cast<std::uint8_t>(kind)).put(static_cast<std::uint8_t>(device));
  w.put(device_ordinal).put(source_id).put_fixed(opaque);
  return w.take();
}

event_source event_source::deserialize(std::span<const std::byte> bytes, unique_fd fd) {
  constexpr const char* what = "event source";
  auto r = expect_header(bytes, wire_bytes, source_magic, what);
  event_source s;
  const auto kind = r.get<std::uint8_t>("kind");
  if (kind != static_cast<std::uint8_t>(event_source_kind::host_page) &&
      kind != static_cast<std::uint8_t>(event_source_kind::cuda_ipc_event)) {
    malformed(what, "unknown source kind " + std::to_string(kind));
  }
  s.kind = static_cast<event_source_kind>(kind);
  const auto dev = r.get<std::uint8_t>("device");
  if (dev != static_cast<std::uint8_t>(device_kind::host) && dev != static_cast<std::uint8_t>(device_kind::cuda)) {
    malformed(what, "unknown device kind " + std::to_string(dev));
  }
  s.device = static_cast<device_kind>(dev);
  if ((s.device == device_kind::host) != (s.kind == event_source_kind::host_page)) {
    malformed(what, "source kind " + std::to_string(kind) + " does not belong to device kind " +
                        std::string(to_string(s.device)));
  }
  s.device_ordinal = r.get<std::int32_t>("ordinal");
  if (s.device_ordinal < 0) malformed(what, "negative device ordinal");
  if (s.device == device_kind::host && s.device_ordinal != 0) {
    malformed(what, "host device ordinal " + std::to_string(s.device_ordinal) + "; the host device is always 0");
  }
  s.source_id = r.get<std::uint64_t>("source_id");
  if (s.source_id == 0) malformed(what, "source id 0");
  const auto opaque = r.get_fixed("opaque", opaque_bytes);
  r.finish();
  std::copy(opaque.begin(), opaque.end(), s.opaque.begin());  // a CUDA handle is the driver's to check
  if (carries_fd(s.kind) && std::any_of(s.opaque.begin(), s.opaque.end(), [](std::byte b) { return b != std::byte{0}; })) {
    malformed(what, "opaque bytes in a kind of source that has none");
  }
  if (carries_fd(s.kind) && !fd.valid()) malformed(what, "this kind of source needs a file descriptor and none came with it");
  if (!carries_fd(s.kind) && fd.valid()) malformed(what, "a file descriptor came with a kind of source that takes none");
  s.fd = std::move(fd);
  return s;
}

}  // namespace shoal::backend
