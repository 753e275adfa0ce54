// Spare device events, reused so that a cross-stream free rarely creates one.
//
// Invariants: an event in the spare list is owned by nobody else (no block's
// waits, no caller); the destructor destroys exactly those. The list has
// room for every event made so far, so give_back never allocates.
// Thread-safety: take and give_back may be called from any thread at once;
// the spin lock guarding the list is a leaf of the allocator's lock order
// (taken under a pool lock, nothing taken under it).
#pragma once

#include <cstddef>
#include <vector>

#include "alloc/spin_lock.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

class event_pool {
 public:
  explicit event_pool(backend::device& device) : device_(device) {}
  ~event_pool();
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;

  /// A spare event, or a new one from the device.
  [[nodiscard]] backend::event_ref take();
  /// Takes back an event its user no longer needs.
  void give_back(backend::event_ref event) noexcept;

 private:
  backend::device& device_;
  spin_lock lock_;
  std::vector<backend::event_ref> spare_;  // guarded by lock_
  std::size_t made_ = 0;                   // guarded by lock_; events made and not destroyed
};

}  // namespace shoal::alloc::detail
