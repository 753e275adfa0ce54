// The frames a receiver holds that came on the socket ahead of their markers
// in the peer's ring (a frame with a descriptor, or too large for the ring).
//
// An honest sender publishes a batch's markers before it sends its next
// batch, so at most two batches wait here: more frames, payload bytes or
// descriptors than two batches may carry is a protocol_error, whatever the
// batches' shapes (a peer sending one large frame a batch, and no markers,
// would otherwise have a connection hold 128 frames of max_payload each).
//
// Not thread-safe: the connection's receive lock guards it.
#pragma once

#include <cstddef>
#include <deque>

#include "shoal/channel/channel.h"

namespace shoal::channel::detail {

class frames_ahead_of_markers {
 public:
  /// Holds `f`; protocol_error, holding nothing more, when it would take
  /// past two batches of frames of at most `max_payload` bytes.
  void push(frame f, std::size_t max_payload);
  /// The oldest frame held; only when !empty().
  [[nodiscard]] frame pop();
  [[nodiscard]] bool empty() const noexcept { return frames_.empty(); }

 private:
  std::deque<frame> frames_;
  std::size_t payload_bytes_ = 0;
  std::size_t descriptors_ = 0;
};

}  // namespace shoal::channel::detail
