// The sharing protocol's messages, one struct each, with their wire forms.
//
// A producer announces each resource once per connection before the first
// storage message that refers to it: a counter file, a segment (one exported
// segment or chunk), an event source. Then each storage message names them
// by id. Retire messages say a resource is gone on the producer's side, so
// the consumer may close its copy once nothing uses it.
//
// decode_* validate every field against the limits given and throw
// protocol_error; they never trust a length, count or id range.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "ipc/counters/counter_file.h"
#include "shoal/ipc/sharing_types.h"
#include "shoal/backend/shareable_event.h"
#include "shoal/backend/shareable_handle.h"

namespace shoal::ipc::detail {

enum class message_type : std::uint16_t {
  counter_file = 1,     // + the file's descriptor
  segment = 2,          // + the segment's descriptor, where its kind has one
  event_source = 3,     // + the page's descriptor on the host backend
  storage = 4,
  retire_segments = 5,
  retire_files = 6,
  note = 7,             // metadata alone, no storage
};

struct counter_file_message {
  std::uint64_t file_id = 0;
  std::uint32_t slots = 0;
};

struct segment_message {
  std::uint64_t segment_id = 0;
  backend::shareable_handle handle;
};

struct storage_message {
  std::vector<std::uint64_t> segment_ids;  // the chunks it spans, in address order
  std::uint64_t offset = 0;                // of the data in the first one
  std::uint64_t size = 0;
  std::uint64_t file_id = 0;
  slot_ticket slot;
  // The point after the producer's writes before the share; none when its
  // stream had finished them all at send time (no wait needed: a wait on a
  // CUDA interprocess event costs ~150 us even when it is passed).
  std::optional<backend::event_point> ready;
  std::span<const std::byte> metadata;     // points into the decoded payload
};

struct limits {
  std::size_t max_metadata = 0;
  std::size_t max_segments_per_storage = 0;
};

[[nodiscard]] std::vector<std::byte> encode(const counter_file_message& m);
[[nodiscard]] std::vector<std::byte> encode_segment(std::uint64_t segment_id, const backend::shareable_handle& handle);
[[nodiscard]] std::vector<std::byte> encode(const storage_message& m);
[[nodiscard]] std::vector<std::byte> encode_ids(std::span<const std::uint64_t> ids);
[[nodiscard]] std::vector<std::byte> encode_note(std::span<const std::byte> metadata);

[[nodiscard]] counter_file_message decode_counter_file(std::span<const std::byte> payload, std::uint32_t max_slots);
[[nodiscard]] segment_message decode_segment(std::span<const std::byte> payload, unique_fd fd);
[[nodiscard]] storage_message decode_storage(std::span<const std::byte> payload, const limits& lim);
[[nodiscard]] std::vector<std::uint64_t> decode_ids(std::span<const std::byte> payload, const char* message);
[[nodiscard]] std::span<const std::byte> decode_note(std::span<const std::byte> payload, const limits& lim);

}  // namespace shoal::ipc::detail
