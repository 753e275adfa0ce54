// The streams on which shoal enqueued work of its own on one storage's data
// — a materializing copy into it, a steal's waits for the family's copies
// and reads, an eager clone's copy out of it — and the streams ordered after
// that work since. A use of the storage on any other stream waits for the
// fences first (once per stream): its caller ordered its own work across
// streams (or had no need to, for disjoint writes), but could not order work
// it never saw, so without the wait a write on a second stream could be
// overwritten by the copy into the data, or overtake a clone's copy out of
// it. A storage shoal never worked on has no fences and pays nothing.
//
// Not thread-safe: the owning storage guards it.
#pragma once

#include <algorithm>
#include <span>
#include <vector>

#include "storage/stream_set.h"

namespace shoal::storage::detail {

class stream_fences {
 public:
  /// Room for start_over and for one more fence: then neither throws.
  void make_room() {
    fences_.reserve(fences_.size() + 1);
    if (ordered_.capacity() == 0) ordered_.reserve(1);
  }
  /// Shoal's work on `stream` is all there is to wait for: the data is a
  /// new block written by a copy there, or stolen after `stream` waited
  /// for everything before. Needs make_room first.
  void start_over(backend::stream_ref stream) noexcept {
    fences_.assign(1, stream);
    ordered_.assign(1, stream);
  }
  /// Shoal's work on `stream` comes after what was there: every other
  /// stream waits again. Needs make_room first.
  void add(backend::stream_ref stream) noexcept {
    if (std::ranges::find(fences_, stream) == fences_.end()) fences_.push_back(stream);
    ordered_.assign(1, stream);
  }
  /// Makes `stream` wait for the fences, unless it did since the last one.
  /// A throw leaves it unordered, to be ordered at its next use.
  void order(backend::device& device, backend::stream_ref stream) {
    if (fences_.empty() || std::ranges::find(ordered_, stream) != ordered_.end()) return;
    order_after(device, stream, fences_);
    ordered_.push_back(stream);
  }

 private:
  std::vector<backend::stream_ref> fences_;
  std::vector<backend::stream_ref> ordered_;  // waited for every fence since it was added
};

}  // namespace shoal::storage::detail
