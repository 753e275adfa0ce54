#include "shoal/backend/stream.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace shoal::backend {

stream& stream::operator=(stream&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    ref_ = std::exchange(other.ref_, {});
  }
  return *this;
}

void stream::reset() noexcept {
  if (device_ != nullptr && !ref_.is_default()) {
    try {
      device_->destroy_stream(ref_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
    }
  }
  device_ = nullptr;
  ref_ = {};
}

event& event::operator=(event&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    ref_ = std::exchange(other.ref_, {});
  }
  return *this;
}

void event::reset() noexcept {
  if (device_ != nullptr && ref_.native != nullptr) {
    try {
      device_->destroy_event(ref_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
    }
  }
  device_ = nullptr;
  ref_ = {};
}

namespace {

// Per-thread current stream of each device, keyed by the device's serial
// (never reused, so a slot left by a destroyed device can never be mistaken
// for a new device's). Few devices per process: a flat vector is fastest.
struct current_slot {
  std::uint64_t device_serial;
  stream_ref stream;
};
thread_local std::vector<current_slot> current_slots;
// How many slots there are: trivially constructed, so a thread that never
// set a current stream answers "default" without touching the vector.
thread_local std::size_t current_slot_count = 0;

current_slot* find_slot(std::uint64_t serial) noexcept {
  for (auto& slot : current_slots) {
    if (slot.device_serial == serial) return &slot;
  }
  return nullptr;
}

}  // namespace

stream_ref current_stream(const device& dev) noexcept {
  if (current_slot_count == 0) return {};
  const current_slot* slot = find_slot(dev.serial());
  return slot != nullptr ? slot->stream : stream_ref{};
}

stream_guard::stream_guard(const device& dev, stream_ref s) : device_(dev), previous_(current_stream(dev)) {
  if (current_slot* slot = find_slot(dev.serial())) {
    slot->stream = s;
  } else {
    current_slots.push_back({dev.serial(), s});
  }
  current_slot_count = current_slots.size();
}

stream_guard::~stream_guard() {
  current_slot* slot = find_slot(device_.serial());
  if (previous_.is_default()) {
    std::erase_if(current_slots, [&](const current_slot& s) { return &s == slot; });
  } else {
    slot->stream = previous_;
  }
  current_slot_count = current_slots.size();
}

}  // namespace shoal::backend
