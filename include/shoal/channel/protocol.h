// Protocols over a channel name themselves in their first frame.
//
// A channel carries frames; what they mean is up to the protocol on top
// (storage sharing, memory lending). Each side of a protocol sends a hello
// frame first — the protocol's name and version — and checks the other
// side's before it reads anything else, so a client of another protocol, or
// of another version of this one, gets a protocol_error that names both
// instead of a confusing failure on some later message.
//
// Wire form of the hello payload (core's codec, little-endian):
//   name length u32 | name bytes (at most max_protocol_name_bytes) | version u16
// sent as a frame of type hello_frame_type, with no descriptor.
//
// Thread-safety: free functions over a connection, as thread-safe as its
// send() and receive().
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shoal/channel/channel.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::channel {

/// The frame type of a hello; protocols use other types for their messages.
inline constexpr std::uint16_t hello_frame_type = 0xFFFF;
inline constexpr std::size_t max_protocol_name_bytes = 64;

/// A protocol's name ("shoal.sharing") and version.
struct protocol_id {
  std::string_view name;
  std::uint16_t version = 0;

  /// "shoal.sharing version 1", for messages.
  [[nodiscard]] std::string to_string() const;
};

/// The payload of `ours`'s hello frame.
[[nodiscard]] std::vector<std::byte> encode_hello(const protocol_id& ours);

/// Sends `ours`'s hello; a protocol calls this before it sends anything else
/// on `link`. Throws as connection::send does.
void send_hello(connection& link, const protocol_id& ours);

/// Checks that `first` — the first frame the peer sent — is a hello for
/// exactly `expected`. Throws protocol_error naming what the peer speaks and
/// what this side speaks when it is another protocol or version, or not a
/// hello at all.
void check_hello(const frame& first, const protocol_id& expected);

/// check_hello for a side that speaks several protocols on one socket (the
/// lender: borrowers and observers): the index in `expected` of the one the
/// peer's hello names. Throws as check_hello does when it names none of them.
[[nodiscard]] std::size_t check_hello_one_of(const frame& first, std::span<const protocol_id> expected);

}  // namespace shoal::channel

#pragma GCC visibility pop
