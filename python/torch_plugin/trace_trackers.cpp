#include "trace_trackers.h"

#include <cstdio>
#include <exception>
#include <utility>

namespace shoal_torch {

void trace_trackers::attach(tracker t) {
  std::lock_guard lock(mutex_);
  trackers_.push_back(std::move(t));
  count_.store(trackers_.size(), std::memory_order_relaxed);
}

void trace_trackers::notify(const trace_entry& entry) const noexcept {
  // Called under shoal's locks, never from inside a tracker of this list
  // (a tracker must not allocate): holding mutex_ while they run is safe.
  std::lock_guard lock(mutex_);
  for (const tracker& t : trackers_) {
    try {
      t(entry);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shoal: an allocator trace tracker failed: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "shoal: an allocator trace tracker failed\n");
    }
  }
}

}  // namespace shoal_torch
