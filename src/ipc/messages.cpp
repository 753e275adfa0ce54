#include "ipc/messages.h"

#include <string>

#include "core/wire.h"

namespace shoal::ipc::detail {

using shoal::detail::wire_reader;
using shoal::detail::wire_writer;

namespace {

// Ids are never 0: a zero is a sign of a malformed (e.g. zeroed) message.
std::uint64_t get_id(wire_reader& r, const char* field) {
  const auto id = r.get<std::uint64_t>(field);
  if (id == 0) r.fail(field, "an id of 0");
  return id;
}

}  // namespace

std::vector<std::byte> encode(const counter_file_message& m) {
  wire_writer w;
  w.put(m.file_id).put(m.slots);
  return w.take();
}

std::vector<std::byte> encode_segment(std::uint64_t segment_id, const backend::shareable_handle& handle) {
  wire_writer w;
  w.put(segment_id).put_bytes(handle.serialize());
  return w.take();
}

std::vector<std::byte> encode(const storage_message& m) {
  // Reserved whole: a storage message is on every send's path.
  wire_writer w(64 + 8 * m.segment_ids.size() + (m.ready ? backend::event_point::wire_bytes + 4 : 0) + m.metadata.size());
  w.put(static_cast<std::uint32_t>(m.segment_ids.size()));
  for (auto id : m.segment_ids) w.put(id);
  w.put(m.offset).put(m.size).put(m.file_id).put(m.slot.index).put(m.slot.generation);
  w.put(static_cast<std::uint8_t>(m.ready ? 1 : 0));
  if (m.ready) w.put_bytes(m.ready->serialize());
  w.put_bytes(m.metadata);
  return w.take();
}

std::vector<std::byte> encode_ids(std::span<const std::uint64_t> ids) {
  wire_writer w;
  w.put(static_cast<std::uint32_t>(ids.size()));
  for (auto id : ids) w.put(id);
  return w.take();
}

std::vector<std::byte> encode_note(std::span<const std::byte> metadata) {
  wire_writer w(4 + metadata.size());
  w.put_bytes(metadata);
  return w.take();
}

counter_file_message decode_counter_file(std::span<const std::byte> payload, std::uint32_t max_slots) {
  wire_reader r(payload, "counter_file");
  counter_file_message m;
  m.file_id = get_id(r, "file_id");
  m.slots = r.get<std::uint32_t>("slots");
  if (m.slots == 0 || m.slots > max_slots) {
    r.fail("slots", std::to_string(m.slots) + " is outside 1.." + std::to_string(max_slots));
  }
  r.finish();
  return m;
}

segment_message decode_segment(std::span<const std::byte> payload, unique_fd fd) {
  wire_reader r(payload, "segment");
  segment_message m;
  m.segment_id = get_id(r, "segment_id");
  const auto handle_bytes = r.get_bytes("handle", backend::shareable_handle::wire_bytes);
  r.finish();
  m.handle = backend::shareable_handle::deserialize(handle_bytes, std::move(fd));
  return m;
}

storage_message decode_storage(std::span<const std::byte> payload, const limits& lim) {
  wire_reader r(payload, "storage");
  storage_message m;
  const auto count = r.get<std::uint32_t>("segment_count");
  if (count == 0 || count > lim.max_segments_per_storage) {
    r.fail("segment_count", std::to_string(count) + " is outside 1.." + std::to_string(lim.max_segments_per_storage));
  }
  m.segment_ids.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) m.segment_ids.push_back(get_id(r, "segment_ids"));
  m.offset = r.get<std::uint64_t>("offset");
  m.size = r.get<std::uint64_t>("size");
  if (m.size == 0) r.fail("size", "a storage of 0 bytes");
  m.file_id = get_id(r, "file_id");
  m.slot.index = r.get<std::uint32_t>("slot_index");
  m.slot.generation = r.get<std::uint32_t>("slot_generation");
  const auto has_ready = r.get<std::uint8_t>("has_ready");
  if (has_ready > 1) r.fail("has_ready", std::to_string(has_ready) + " is neither 0 nor 1");
  if (has_ready == 1) m.ready = backend::event_point::deserialize(r.get_bytes("ready", backend::event_point::wire_bytes));
  m.metadata = r.get_bytes("metadata", lim.max_metadata);
  r.finish();
  return m;
}

std::vector<std::uint64_t> decode_ids(std::span<const std::byte> payload, const char* message) {
  wire_reader r(payload, message);
  const auto count = r.get<std::uint32_t>("count");
  if (count > payload.size() / sizeof(std::uint64_t)) r.fail("count", std::to_string(count) + " ids cannot fit");
  std::vector<std::uint64_t> ids;
  ids.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) ids.push_back(get_id(r, "ids"));
  r.finish();
  return ids;
}

std::span<const std::byte> decode_note(std::span<const std::byte> payload, const limits& lim) {
  wire_reader r(payload, "note");
  auto metadata = r.get_bytes("metadata", lim.max_metadata);
  r.finish();
  return metadata;
}

}  // namespace shoal::ipc::detail
