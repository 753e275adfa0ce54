// The lending protocol's messages, with their wire forms (core's codec).
//
// After the hellos ("shoal.lending" version 1), a borrower sends borrow,
// give_back and query_metrics; the lender answers each borrow with lent
// (followed by one chunk frame per chunk, each with its descriptor where the
// handle kind has one) or refused, each give_back with given_back or
// refused, and each query_metrics with metrics. The lender may send revoke
// at any time, unasked: a borrower gives the region back (give_back) within
// the deadline it names.
//
// decode_* check every field (sizes, counts, modes, the purpose's bytes) and
// throw protocol_error naming the message and field; they never trust a
// length or a count.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shoal/backend/shareable_handle.h"
#include "shoal/channel/protocol.h"
#include "shoal/lending/lending_types.h"

namespace shoal::lending::detail {

/// What each side says in its hello.
inline constexpr channel::protocol_id lending_protocol{protocol_name, protocol_version};

enum class message_type : std::uint16_t {
  borrow = 1,         // borrower -> lender
  lent = 2,           // lender -> borrower, then `chunks` chunk frames
  chunk = 3,          // lender -> borrower: a serialized handle (+ its descriptor)
  refused = 4,        // lender -> borrower
  give_back = 5,      // borrower -> lender
  given_back = 6,     // lender -> borrower
  query_metrics = 7,  // borrower -> lender, no payload
  metrics = 8,        // lender -> borrower: the Prometheus text
  revoke = 9,         // lender -> borrower, at any time: give this region back by the deadline
};

enum class refusal : std::uint8_t {
  capacity = 1,      // the lender has not that much left
  quota = 2,         // this borrower holds its quota of bytes or regions
  bad_request = 3,   // a size or purpose out of range, an unknown region
  device_error = 4,  // the device failed on the lender's side
};

struct borrow_message {
  std::uint64_t request = 0;
  std::uint64_t bytes = 0;
  region_mode mode = region_mode::exclusive;
  std::string purpose;
};

struct lent_message {
  std::uint64_t request = 0;
  std::uint64_t region = 0;
  std::uint64_t bytes = 0;
  std::uint32_t chunks = 0;
};

struct refused_message {
  std::uint64_t request = 0;
  refusal reason = refusal::bad_request;
  std::string why;
};

inline constexpr std::size_t max_refusal_text = 512;
inline constexpr std::uint32_t max_chunks_per_region = 4096;
inline constexpr std::size_t max_metrics_text = 1 << 20;

[[nodiscard]] std::vector<std::byte> encode(const borrow_message& m);
[[nodiscard]] std::vector<std::byte> encode(const lent_message& m);
[[nodiscard]] std::vector<std::byte> encode(const refused_message& m);
struct revoke_message {
  std::uint64_t region = 0;
  std::uint32_t deadline_ms = 0;  ///< from when it was sent
};

[[nodiscard]] std::vector<std::byte> encode_region(std::uint64_t region);  // give_back, given_back
[[nodiscard]] std::vector<std::byte> encode(const revoke_message& m);
[[nodiscard]] revoke_message decode_revoke(std::span<const std::byte> payload);

[[nodiscard]] borrow_message decode_borrow(std::span<const std::byte> payload);
[[nodiscard]] lent_message decode_lent(std::span<const std::byte> payload);
[[nodiscard]] refused_message decode_refused(std::span<const std::byte> payload);
[[nodiscard]] std::uint64_t decode_region(std::span<const std::byte> payload, const char* message);

/// Whether `purpose` is a valid purpose (1..max_purpose_bytes of printable ASCII).
[[nodiscard]] bool valid_purpose(std::string_view purpose) noexcept;

}  // namespace shoal::lending::detail
