// The streams one storage's data was used on, its own stream first (the one
// its memory was allocated, adopted, received or copied on), each once.
// Up to two streams need no heap memory: the common single-stream storage,
// and the producer/consumer pair, cost no allocation.
//
// Not thread-safe: the owning storage guards it.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <vector>

#include "shoal/backend/device.h"

namespace shoal::storage::detail {

class stream_set {
 public:
  explicit stream_set(backend::stream_ref own) : size_(1) { inline_[0] = own; }

  [[nodiscard]] backend::stream_ref own() const noexcept { return view().front(); }
  [[nodiscard]] std::span<const backend::stream_ref> view() const noexcept {
    return spilled_.empty() ? std::span<const backend::stream_ref>(inline_.data(), size_)
                            : std::span<const backend::stream_ref>(spilled_);
  }
  /// The streams other than own().
  [[nodiscard]] std::span<const backend::stream_ref> others() const noexcept { return view().subspan(1); }

  void add(backend::stream_ref s) {
    const auto all = view();
    if (std::ranges::find(all, s) != all.end()) return;
    if (spilled_.empty() && size_ < inline_.size()) {
      inline_[size_++] = s;
      return;
    }
    if (spilled_.empty()) spilled_.assign(inline_.begin(), inline_.end());
    spilled_.push_back(s);
  }
  /// Makes room for `streams`, so that adding them afterwards cannot throw.
  void make_room_for(std::initializer_list<backend::stream_ref> streams) {
    const auto all = view();
    const auto absent = std::ranges::count_if(streams, [&](auto s) { return std::ranges::find(all, s) == all.end(); });
    const std::size_t needed = all.size() + static_cast<std::size_t>(absent);
    if (needed <= inline_.size()) return;
    const bool inline_now = spilled_.empty();
    spilled_.reserve(needed);  // `all` still views inline_ when inline_now
    if (inline_now) spilled_.assign(all.begin(), all.end());
  }
  /// `own` first (the storage's memory is now a block of `own`); the
  /// streams before it stay, as others: work queued on them may still read
  /// the storage without having recorded it (its first stream needs no
  /// record). Needs make_room_for({own}) first: then it does not throw.
  void make_own(backend::stream_ref own) {
    add(own);
    backend::stream_ref* const first = spilled_.empty() ? inline_.data() : spilled_.data();
    const std::size_t count = spilled_.empty() ? size_ : spilled_.size();
    backend::stream_ref* const at = std::find(first, first + count, own);
    std::rotate(first, at, at + 1);  // `own` to the front, the others in their order after it
  }

 private:
  std::array<backend::stream_ref, 2> inline_{};
  std::size_t size_;
  std::vector<backend::stream_ref> spilled_;  // every stream, once inline_ is full
};

/// Makes work enqueued on `waiter` from now on wait for the work enqueued so
/// far on each of `streams` (GPU-side: an event per stream other than `waiter`).
inline void order_after(backend::device& device, backend::stream_ref waiter,
                        std::span<const backend::stream_ref> streams) {
  for (auto s : streams) {
    if (s == waiter) continue;  // same stream: already in order
    // Destroyed however record or wait ends (a throw included): never leaked.
    struct owned_event {
      explicit owned_event(backend::device& d) : device(d), event(d.create_event()) {}
      owned_event(const owned_event&) = delete;
      owned_event& operator=(const owned_event&) = delete;
      ~owned_event() {
        try {
          device.destroy_event(event);
        } catch (...) {  // NOLINT(bugprone-empty-catch): a refused destroy leaks one event, nothing worse
        }
      }
      backend::device& device;
      const backend::event_ref event;
    } e(device);
    device.record(e.event, s);
    device.wait(waiter, e.event);
  }
}

}  // namespace shoal::storage::detail
