#include "alloc/held_streams.h"

#include <algorithm>

namespace shoal::alloc::detail {

void held_streams::hold(backend::stream_ref stream) {
  if (stream.is_default()) return;
  std::lock_guard lock(mutex_);
  if (std::find(streams_.begin(), streams_.end(), stream) != streams_.end()) return;
  streams_.reserve(streams_.size() + 1);  // first: a refusal leaves no hold without its entry
  device_.hold_stream(stream);
  streams_.push_back(stream);
}

void held_streams::synchronize_all() noexcept {
  std::lock_guard lock(mutex_);  // teardown: no hold can be waiting for it
  for (auto stream : streams_) {
    try {
      device_.synchronize(stream);
    } catch (...) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
    }
  }
}

void held_streams::release_all() noexcept {
  std::vector<backend::stream_ref> held;
  {
    std::lock_guard lock(mutex_);
    held.swap(streams_);
  }
  for (auto stream : held) {  // a last release destroys the stream: not under the lock
    try {
      device_.release_stream(stream);
    } catch (...) {  // NOLINT(bugprone-empty-catch): teardown goes on; the device may be gone
    }
  }
}

}  // namespace shoal::alloc::detail
