#include "lending/messages.h"

#include <algorithm>

#include "core/wire.h"

namespace shoal::lending::detail {

namespace {

using shoal::detail::wire_reader;
using shoal::detail::wire_writer;

std::span<const std::byte> as_bytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::string as_text(std::span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

}  // namespace

bool valid_purpose(std::string_view purpose) noexcept {
  return !purpose.empty() && purpose.size() <= max_purpose_bytes &&
         std::all_of(purpose.begin(), purpose.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

std::vector<std::byte> encode(const borrow_message& m) {
  wire_writer w;
  w.put(m.request).put(m.bytes).put(static_cast<std::uint8_t>(m.mode)).put_bytes(as_bytes(m.purpose));
  return w.take();
}

std::vector<std::byte> encode(const lent_message& m) {
  wire_writer w;
  w.put(m.request).put(m.region).put(m.bytes).put(m.chunks);
  return w.take();
}

std::vector<std::byte> encode(const refused_message& m) {
  wire_writer w;
  const std::string_view why = std::string_view(m.why).substr(0, max_refusal_text);
  w.put(m.request).put(static_cast<std::uint8_t>(m.reason)).put_bytes(as_bytes(why));
  return w.take();
}

std::vector<std::byte> encode_region(std::uint64_t region) {
  wire_writer w;
  w.put(region);
  return w.take();
}

borrow_message decode_borrow(std::span<const std::byte> payload) {
  wire_reader r(payload, "borrow");
  borrow_message m;
  m.request = r.get<std::uint64_t>("request");
  m.bytes = r.get<std::uint64_t>("bytes");
  if (m.bytes == 0) r.fail("bytes", "a region of 0 bytes");
  const auto mode = r.get<std::uint8_t>("mode");
  if (mode != static_cast<std::uint8_t>(region_mode::exclusive)) {
    r.fail("mode", "unknown mode " + std::to_string(mode) + " (1: exclusive)");
  }
  m.mode = static_cast<region_mode>(mode);
  m.purpose = as_text(r.get_bytes("purpose", max_purpose_bytes));
  if (!valid_purpose(m.purpose)) r.fail("purpose", "must be 1 to 64 bytes of printable ASCII");
  r.finish();
  return m;
}

lent_message decode_lent(std::span<const std::byte> payload) {
  wire_reader r(payload, "lent");
  lent_message m;
  m.request = r.get<std::uint64_t>("request");
  m.region = r.get<std::uint64_t>("region");
  m.bytes = r.get<std::uint64_t>("bytes");
  m.chunks = r.get<std::uint32_t>("chunks");
  if (m.chunks == 0 || m.chunks > max_chunks_per_region) {
    r.fail("chunks", std::to_string(m.chunks) + " is not in 1.." + std::to_string(max_chunks_per_region));
  }
  r.finish();
  return m;
}

refused_message decode_refused(std::span<const std::byte> payload) {
  wire_reader r(payload, "refused");
  refused_message m;
  m.request = r.get<std::uint64_t>("request");
  const auto reason = r.get<std::uint8_t>("reason");
  if (reason < static_cast<std::uint8_t>(refusal::capacity) ||
      reason > static_cast<std::uint8_t>(refusal::device_error)) {
    r.fail("reason", "unknown reason " + std::to_string(reason));
  }
  m.reason = static_cast<refusal>(reason);
  m.why = as_text(r.get_bytes("why", max_refusal_text));
  r.finish();
  return m;
}

std::vector<std::byte> encode(const revoke_message& m) {
  wire_writer w;
  w.put(m.region).put(m.deadline_ms);
  return w.take();
}

revoke_message decode_revoke(std::span<const std::byte> payload) {
  wire_reader r(payload, "revoke");
  revoke_message m;
  m.region = r.get<std::uint64_t>("region");
  m.deadline_ms = r.get<std::uint32_t>("deadline_ms");
  r.finish();
  return m;
}

std::uint64_t decode_region(std::span<const std::byte> payload, const char* message) {
  wire_reader r(payload, message);
  const auto region = r.get<std::uint64_t>("region");
  r.finish();
  return region;
}

}  // namespace shoal::lending::detail
