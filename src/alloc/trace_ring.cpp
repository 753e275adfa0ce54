#include "alloc/trace_ring.h"

#include <chrono>

namespace shoal::alloc::detail {

namespace {

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

}  // namespace

void trace_ring::note(trace_action action, std::uintptr_t address, std::size_t size,
                      backend::stream_ref stream) noexcept {
  std::lock_guard lock(mutex_);
  entries_[next_] = trace_entry{action, address, size, stream, now_ns()};
  if (++next_ == entries_.size()) {
    next_ = 0;
    wrapped_ = true;
  }
}

std::vector<trace_entry> trace_ring::entries() const {
  std::lock_guard lock(mutex_);
  std::vector<trace_entry> out;
  if (wrapped_) out.insert(out.end(), entries_.begin() + static_cast<std::ptrdiff_t>(next_), entries_.end());
  out.insert(out.end(), entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(next_));
  return out;
}

}  // namespace shoal::alloc::detail
