#include "shoal/backend/shareable_event.h"

#include <algorithm>
#include <string>

#include "backend/wire_fields.h"
#include "shoal/error.h"

namespace shoal::backend {

namespace {

using detail::put_field;
using detail::take_field;

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

void expect_header(std::span<const std::byte>& bytes, std::size_t wire_bytes, std::uint32_t magic, const char* what) {
  if (bytes.size() != wire_bytes) {
    malformed(what, "expected " + std::to_string(wire_bytes) + " bytes, got " + std::to_string(bytes.size()));
  }
  if (take_field<std::uint32_t>(bytes) != magic) malformed(what, "bad magic number");
  if (const auto version = take_field<std::uint16_t>(bytes); version != wire_version) {
    malformed(what, "wire version " + std::to_string(version) + ", this process speaks " + std::to_string(wire_version));
  }
}

}  // namespace

std::vector<std::byte> event_point::serialize() const {
  std::vector<std::byte> out;
  out.reserve(wire_bytes);
  put_field(out, point_magic);
  put_field(out, wire_version);
  put_field(out, stream_slot);
  put_field(out, source_id);
  put_field(out, ticket);
  return out;
}

event_point event_point::deserialize(std::span<const std::byte> bytes) {
  constexpr const char* what = "event point";
  expect_header(bytes, wire_bytes, point_magic, what);
  event_point p;
  p.stream_slot = take_field<std::uint32_t>(bytes);
  p.source_id = take_field<std::uint64_t>(bytes);
  p.ticket = take_field<std::uint64_t>(bytes);
  if (p.source_id == 0) malformed(what, "source id 0");
  // Whether the slot exists and the ticket fits its kind is up to the
  // source the point is waited on: device::wait_imported checks them.
  return p;
}

std::vector<std::byte> event_source::serialize() const {
  std::vector<std::byte> out;
  out.reserve(wire_bytes);
  put_field(out, source_magic);
  put_field(out, wire_version);
  put_field(out, static_cast<std::uint8_t>(kind));
  put_field(out, static_cast<std::uint8_t>(device));
  put_field(out, device_ordinal);
  put_field(out, source_id);
  out.insert(out.end(), opaque.begin(), opaque.end());
  return out;
}

event_source event_source::deserialize(std::span<const std::byte> bytes, unique_fd fd) {
  constexpr const char* what = "event source";
  expect_header(bytes, wire_bytes, source_magic, what);
  event_source s;
  const auto kind = take_field<std::uint8_t>(bytes);
  if (kind != static_cast<std::uint8_t>(event_source_kind::host_page) &&
      kind != static_cast<std::uint8_t>(event_source_kind::cuda_ipc_event)) {
    malformed(what, "unknown source kind " + std::to_string(kind));
  }
  s.kind = static_cast<event_source_kind>(kind);
  const auto dev = take_field<std::uint8_t>(bytes);
  if (dev != static_cast<std::uint8_t>(device_kind::host) && dev != static_cast<std::uint8_t>(device_kind::cuda)) {
    malformed(what, "unknown device kind " + std::to_string(dev));
  }
  s.device = static_cast<device_kind>(dev);
  if ((s.device == device_kind::host) != (s.kind == event_source_kind::host_page)) {
    malformed(what, "source kind " + std::to_string(kind) + " does not belong to device kind " +
                        std::string(to_string(s.device)));
  }
  s.device_ordinal = take_field<std::int32_t>(bytes);
  if (s.device_ordinal < 0) malformed(what, "negative device ordinal");
  if (s.device == device_kind::host && s.device_ordinal != 0) {
    malformed(what, "host device ordinal " + std::to_string(s.device_ordinal) + "; the host device is always 0");
  }
  s.source_id = take_field<std::uint64_t>(bytes);
  if (s.source_id == 0) malformed(what, "source id 0");
  std::copy(bytes.begin(), bytes.end(), s.opaque.begin());  // a CUDA handle is the driver's to check
  if (carries_fd(s.kind) && std::any_of(s.opaque.begin(), s.opaque.end(), [](std::byte b) { return b != std::byte{0}; })) {
    malformed(what, "opaque bytes in a kind of source that has none");
  }
  if (carries_fd(s.kind) && !fd.valid()) malformed(what, "this kind of source needs a file descriptor and none came with it");
  if (!carries_fd(s.kind) && fd.valid()) malformed(what, "a file descriptor came with a kind of source that takes none");
  s.fd = std::move(fd);
  return s;
}

}  // namespace shoal::backend
