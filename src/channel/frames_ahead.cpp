#include "channel/frames_ahead.h"

#include <string>
#include <utility>

#include "channel/frame_batch.h"
#include "shoal/core/error.h"

namespace shoal::channel::detail {

void frames_ahead_of_markers::push(frame f, std::size_t max_payload) {
  constexpr std::size_t batches = 2;
  const std::size_t payload = payload_bytes_ + f.payload.size();
  const std::size_t descriptors = descriptors_ + (f.fd ? 1 : 0);
  if (frames_.size() + 1 > batches * max_batch_frames || descriptors > batches * max_batch_descriptors ||
      payload > batches * max_batch_body(max_payload)) {
    throw protocol_error("frames on the socket ahead of their markers in the ring past what two batches carry (" +
                         std::to_string(frames_.size() + 1) + " frames, " + std::to_string(payload) +
                         " payload bytes, " + std::to_string(descriptors) +
                         " descriptors): an honest sender publishes a batch's markers before its next batch");
  }
  frames_.push_back(std::move(f));
  payload_bytes_ = payload;
  descriptors_ = descriptors;
}

frame frames_ahead_of_markers::pop() {
  frame f = std::move(frames_.front());
  frames_.pop_front();
  payload_bytes_ -= f.payload.size();
  descriptors_ -= f.fd ? 1 : 0;
  return f;
}

}  // namespace shoal::channel::detail
