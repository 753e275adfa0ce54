// A bare transport for tests that must not rest on the channel layer
// (backend tests hand handles to a child process with it): messages with an
// optional file descriptor over a connected UNIX stream socket, a 4-byte
// length, the payload, and the descriptor sent with the first byte
// (SCM_RIGHTS). No credentials and no version: never for library code, where
// nothing crosses a process boundary except a checked channel.
//
// Thread-safety: one sender and one receiver per socket at a time.
// A length above the receiver's limit, or more descriptors than one, is
// malformed input: invalid_argument, with every received descriptor closed.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "shoal/core/unique_fd.h"

namespace shoal::testing {

struct message {
  std::vector<std::byte> payload;
  unique_fd fd;  ///< the descriptor that came with the message, if any
};

/// Sends `payload` and, when `fd` >= 0, a copy of `fd`. Blocks until sent.
/// Throws connection_closed if the peer is gone, backend_error otherwise.
void send_message(int socket, std::span<const std::byte> payload, int fd = -1);

/// Receives one message of at most `max_payload` bytes, blocking until it
/// comes. Throws connection_closed on end of stream, invalid_argument on a
/// malformed one.
[[nodiscard]] message receive_message(int socket, std::size_t max_payload);

}  // namespace shoal::testing
