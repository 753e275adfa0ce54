#include "shoal/backend/shareable_handle.h"

#include <cstring>
#include <string>

#include "core/wire.h"
#include "shoal/core/error.h"

namespace shoal::backend {

namespace {

// Wire layout (core/wire.h; little-endian):
//   u32 magic | u16 version | u8 kind | u8 device | i32 ordinal |
//   u64 size | u64 offset | 64 bytes opaque
constexpr std::uint32_t wire_magic = 0x53484844;  // "SHHD"
constexpr std::uint16_t wire_version = 1;

[[noreturn]] void malformed(const std::string& what) {
  throw protocol_error("malformed shareable handle: " + what + "; the sender is not a matching shoal version or sent garbage");
}

}  // namespace

shareable_handle shareable_handle::duplicate() const {
  shareable_handle copy;
  copy.kind = kind;
  copy.device = device;
  copy.device_ordinal = device_ordinal;
  copy.size = size;
  copy.offset = offset;
  copy.opaque = opaque;
  if (fd) copy.fd = fd.duplicate();
  return copy;
}

std::vector<std::byte> shareable_handle::serialize() const {
  shoal::detail::wire_writer w(wire_bytes);
  w.put(wire_magic).put(wire_version).put(static_cast<std::uint8_t>(kind)).put(static_cast<std::uint8_t>(device));
  w.put(device_ordinal).put(size).put(offset).put_fixed(opaque);
  return w.take();
}

shareable_handle shareable_handle::deserialize(std::span<const std::byte> bytes, unique_fd fd) {
  if (bytes.size() != wire_bytes) {
    malformed("expected " + std::to_string(wire_bytes) + " bytes, got " + std::to_string(bytes.size()));
  }
  shoal::detail::wire_reader r(bytes, "shareable handle");
  if (r.get<std::uint32_t>("magic") != wire_magic) malformed("bad magic number");
  if (const auto version = r.get<std::uint16_t>("version"); version != wire_version) {
    malformed("wire version " + std::to_string(version) + ", this process speaks " + std::to_string(wire_version));
  }
  shareable_handle h;
  const auto kind = r.get<std::uint8_t>("kind");
  if (kind < 1 || kind > 3) malformed("unknown handle kind " + std::to_string(kind));
  h.kind = static_cast<handle_kind>(kind);
  const auto dev = r.get<std::uint8_t>("device");
  if (dev != static_cast<std::uint8_t>(device_kind::host) && dev != static_cast<std::uint8_t>(device_kind::cuda)) {
    malformed("unknown device kind " + std::to_string(dev));
  }
  h.device = static_cast<device_kind>(dev);
  if ((h.device == device_kind::host) != (h.kind == handle_kind::host_memfd)) {
    malformed("handle kind does not belong to device kind " + std::string(to_string(h.device)));
  }
  h.device_ordinal = r.get<std::int32_t>("ordinal");
  if (h.device_ordinal < 0) malformed("negative device ordinal");
  h.size = r.get<std::uint64_t>("size");
  h.offset = r.get<std::uint64_t>("offset");
  if (h.size == 0) malformed("zero size");
  if (h.offset >= h.size) {
    malformed("offset " + std::to_string(h.offset) + " is not inside the " + std::to_string(h.size) + "-byte segment");
  }
  const auto opaque = r.get_fixed("opaque", opaque_bytes);
  std::memcpy(h.opaque.data(), opaque.data(), opaque_bytes);
  r.finish();
  if (carries_fd(h.kind) && !fd.valid()) malformed("this kind of handle needs a file descriptor and none came with it");
  if (!carries_fd(h.kind) && fd.valid()) malformed("a file descriptor came with a kind of handle that takes none");
  h.fd = std::move(fd);
  return h;
}

}  // namespace shoal::backend
