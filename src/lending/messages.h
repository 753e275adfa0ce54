// The lending protocol's messages, with their wire forms (core's codec).
//
// After the hellos ("shoal.lending" version 6), a borrower sends borrow,
// give_back, query_metrics, publish and borrow_shared; the lender answers
// each borrow with lent (followed by one chunk frame per chunk, each with its
// descriptor where the handle kind has one) or refused, each give_back with
// given_back or refused, and each query_metrics with metrics. The lender may
// send revoke at any time, unasked: a borrower gives the region back
// (give_back) within the deadline it names.
//
// Memory reuse (version 2): lent names the memory (a chunk id the lender
// assigns, never reused) besides the region. give_back carries keep_mapping:
// the borrower asks to keep its mapping of an exclusive region's memory, and
// given_back says whether the lender recorded it (kept; otherwise the
// borrower unmaps). While a connection keeps a memory mapped, a lent of that
// memory to it carries no chunk frames (chunks == 0) and the borrower uses
// its kept mapping; a lent with no chunks for memory the borrower does not
// keep is a protocol_error. When the lender releases memory some connections
// keep mapped, it sends each of them forget, unasked (like revoke): the
// borrower unmaps it; forget for memory it does not keep is a protocol_error.
//
// Shared regions (version 1 too: nothing had shipped): a writer that holds
// an exclusive region unmaps it and sends publish (the region, its layout
// and content hash); the lender answers with lent and the chunk frames again
// (the writer maps them read-only: its hold goes on, now shared) or refused.
// A reader sends borrow_shared (the name, the hash it expects if any); the
// lender answers with lent, the chunk frames and a layout frame, or refused
// (hash_mismatch when the hash differs). Version 3: borrow_shared may name
// the uid the writer must have (writer_mismatch when another uid published
// the name: names are first come among admitted uids). give_back gives one
// hold of a region back; the region is released when its last hold goes.
//
// decode_* check every field (sizes, counts, modes, the purpose's bytes,
// names, dtypes, ranks) and throw protocol_error naming the message and
// field; they never trust a length or a count. Whether a layout fits its
// region (bounds, overlaps, sizes) is layout_problem's to say: the lender
// refuses such a publish (bad_request), a borrower treats such a layout frame
// as a protocol_error.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shoal/backend/shareable_handle.h"
#include "shoal/channel/protocol.h"
#include "shoal/lending/layout.h"
#include "shoal/lending/lending_types.h"

namespace shoal::lending::detail {

/// What each side says in its hello.
inline constexpr channel::protocol_id lending_protocol{protocol_name, protocol_version};
/// An observer's hello; the lender answers it with lending_protocol's.
inline constexpr channel::protocol_id observer_protocol{observer_protocol_name, protocol_version};

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
  publish = 10,       // borrower -> lender: make an exclusive region it holds shared, with its layout
  borrow_shared = 11, // borrower -> lender: map the region published under a name, read-only
  layout = 12,        // lender -> borrower: a shared region's layout, after its lent and chunk frames
  forget = 13,        // lender -> borrower, at any time: unmap the kept mapping of this memory
  revoke_request = 14,   // borrower -> lender (version 4): revoke a region, whoever holds it; the lender's uid only
  revoke_accepted = 15,  // lender -> borrower: that region's borrower is asked to give it back
  cancel_wait = 16,      // borrower -> lender (version 5): stop waiting; no answer of its own
};
// Version 5: borrow carries wait_ms; a borrow that does not fit waits that
// long at the lender (in order of arrival) for memory to be given back, and
// is answered — lent, or refused when the time is up — like any other.
// A borrower that stops waiting (its deadline passed, or its caller
// interrupted it) sends cancel_wait with that borrow's request: if it still
// waits, the lender refuses it at once; if it was answered already, the
// cancel is dropped (it has no answer of its own). Any other frame from a
// borrower whose borrow waits ends that wait the same way first, so answers
// stay in the order asked.

enum class refusal : std::uint8_t {
  capacity = 1,      // the lender has not that much left
  quota = 2,         // this borrower holds its quota of bytes or regions
  bad_request = 3,   // a size or purpose out of range, an unknown region
  device_error = 4,  // the device failed on the lender's side
  hash_mismatch = 5, // the published region's content hash is not the one asked for
  writer_mismatch = 6,  // the published region's writer is not of the uid asked for
  not_permitted = 7,    // a request only a process of the lender's own uid may make
  // Version 6: what `capacity` said alone, told apart (lending::shortage).
  wait_expired = 8,     // it waited, and not that much came back in time
  others_waiting = 9,   // it did not wait, and other borrows wait in line
  cannot_fit = 10,      // no wait could make it fit
  stopped_waiting = 11, // its borrower stopped waiting
};

struct borrow_message {
  std::uint64_t request = 0;
  std::uint64_t bytes = 0;
  region_mode mode = region_mode::exclusive;
  std::string purpose;
  /// Version 5: how long the borrow may wait at the lender for memory to be
  /// given back (0: refused at once when it does not fit).
  std::uint32_t wait_ms = 0;
};

struct lent_message {
  std::uint64_t request = 0;
  std::uint64_t region = 0;
  std::uint64_t memory = 0;  ///< the chunk's id (> 0): the same memory lent again has the same id
  std::uint64_t bytes = 0;
  std::uint32_t chunks = 0;  ///< 0: the borrower keeps `memory` mapped and uses that mapping
};

struct give_back_message {
  std::uint64_t region = 0;
  bool keep_mapping = false;  ///< the borrower asks to keep its mapping of the region's memory
};

struct given_back_message {
  std::uint64_t region = 0;
  bool kept = false;  ///< the lender recorded the kept mapping; otherwise the borrower unmaps now
};

struct refused_message {
  std::uint64_t request = 0;
  refusal reason = refusal::bad_request;
  std::string why;
};

struct publish_message {
  std::uint64_t request = 0;
  std::uint64_t region = 0;
  region_layout layout;
};

struct borrow_shared_message {
  std::uint64_t request = 0;
  std::string name;
  std::optional<content_hash> expected;
  std::optional<std::uint32_t> writer_uid;  ///< version 3: the uid the region's writer must have
};

struct layout_message {
  std::uint64_t request = 0;
  region_layout layout;
};

/// The largest frame either side accepts: a layout of max_layout_entries
/// entries at their longest fits (about 600 KiB), and so does the metrics
/// text.
inline constexpr std::size_t max_frame_payload = std::size_t{1} << 20;
inline constexpr std::size_t max_refusal_text = 512;
inline constexpr std::uint32_t max_chunks_per_region = 4096;
inline constexpr std::size_t max_metrics_text = max_frame_payload;

[[nodiscard]] std::vector<std::byte> encode(const borrow_message& m);
[[nodiscard]] std::vector<std::byte> encode(const lent_message& m);
[[nodiscard]] std::vector<std::byte> encode(const refused_message& m);
struct revoke_message {
  std::uint64_t region = 0;
  std::uint32_t deadline_ms = 0;  ///< from when it was sent
};

[[nodiscard]] std::vector<std::byte> encode(const revoke_message& m);
[[nodiscard]] revoke_message decode_revoke(std::span<const std::byte> payload);

struct revoke_request_message {
  std::uint64_t request = 0;
  std::uint64_t region = 0;
  std::uint32_t deadline_ms = 0;  ///< 1 ms and up, as lender::revoke takes it
};

[[nodiscard]] std::vector<std::byte> encode(const revoke_request_message& m);
[[nodiscard]] revoke_request_message decode_revoke_request(std::span<const std::byte> payload);
/// revoke_accepted: the request it answers.
[[nodiscard]] std::vector<std::byte> encode_revoke_accepted(std::uint64_t request);
[[nodiscard]] std::uint64_t decode_revoke_accepted(std::span<const std::byte> payload);
/// cancel_wait: the waiting borrow's request.
[[nodiscard]] std::vector<std::byte> encode_cancel_wait(std::uint64_t request);
[[nodiscard]] std::uint64_t decode_cancel_wait(std::span<const std::byte> payload);

[[nodiscard]] std::vector<std::byte> encode(const give_back_message& m);
[[nodiscard]] std::vector<std::byte> encode(const given_back_message& m);
[[nodiscard]] give_back_message decode_give_back(std::span<const std::byte> payload);
[[nodiscard]] given_back_message decode_given_back(std::span<const std::byte> payload);
/// forget: the memory id (> 0).
[[nodiscard]] std::vector<std::byte> encode_forget(std::uint64_t memory);
[[nodiscard]] std::uint64_t decode_forget(std::span<const std::byte> payload);

[[nodiscard]] borrow_message decode_borrow(std::span<const std::byte> payload);
[[nodiscard]] lent_message decode_lent(std::span<const std::byte> payload);
[[nodiscard]] refused_message decode_refused(std::span<const std::byte> payload);

[[nodiscard]] std::vector<std::byte> encode(const publish_message& m);
[[nodiscard]] std::vector<std::byte> encode(const borrow_shared_message& m);
[[nodiscard]] std::vector<std::byte> encode(const layout_message& m);
[[nodiscard]] publish_message decode_publish(std::span<const std::byte> payload);
[[nodiscard]] borrow_shared_message decode_borrow_shared(std::span<const std::byte> payload);
[[nodiscard]] layout_message decode_layout(std::span<const std::byte> payload);

/// Whether `purpose` is a valid purpose (1..max_purpose_bytes of printable ASCII).
[[nodiscard]] bool valid_purpose(std::string_view purpose) noexcept;

}  // namespace shoal::lending::detail
