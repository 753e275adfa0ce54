#include "shoal/backend/device.h"

#include <atomic>
#include <cstdint>

#include "core/address_text.h"
#include "core/fork_epoch.h"
#include "shoal/core/error.h"

namespace shoal::backend {

namespace {
std::atomic<std::uint64_t> next_device_serial{1};
}

device::device()
    : serial_(next_device_serial.fetch_add(1, std::memory_order_relaxed)),
      forks_when_made_(shoal::detail::forks_so_far()) {}

bool device::in_fork_child() const noexcept { return shoal::detail::forks_so_far() != forks_when_made_; }

void device::synchronize_device() {
  throw backend_error("synchronize_device",
                      "device '" + name() +
                          "' does not implement a device-wide wait (its backend::device implementation does not "
                          "override synchronize_device); what needs one, such as a forced clear of a private pool "
                          "(live_blocks::invalidate), is refused and changes nothing: free the blocks instead, or "
                          "implement synchronize_device");
}

void device::destroy_stream(stream_ref stream) {
  if (stream.is_default()) throw invalid_argument("destroy_stream: the default stream cannot be destroyed");
  if (in_fork_child()) return;  // the parent's stream (release_stream's comment in device.h)
  {
    std::lock_guard lock(holds_mutex_);
    if (const auto it = holds_.find(stream.native); it != holds_.end()) {
      if (it->second.destroy_pending) {
        throw invalid_argument("destroy_stream: " + shoal::detail::hex(stream.native) +
                               " was destroyed already (its destroy waits for the last release_stream of the "
                               "holds on it, such as an allocator's that used it)");
      }
      it->second.destroy_pending = true;
      deferred_destroys_.fetch_add(1, std::memory_order_release);
      return;
    }
  }
  destroy_stream_now(stream);
}

void device::hold_stream(stream_ref stream) {
  if (in_fork_child()) return;
  std::lock_guard lock(holds_mutex_);
  ++holds_[stream.native].count;
}

bool device::stream_destroy_pending(stream_ref stream) {
  if (in_fork_child()) return false;  // no holds there (hold_stream)
  std::lock_guard lock(holds_mutex_);
  const auto it = holds_.find(stream.native);
  return it != holds_.end() && it->second.destroy_pending;
}

void device::release_stream(stream_ref stream) {
  if (in_fork_child()) return;
  {
    std::lock_guard lock(holds_mutex_);
    const auto it = holds_.find(stream.native);
    if (it == holds_.end()) {
      throw invalid_argument("release_stream: " + shoal::detail::hex(stream.native) +
                             " has no hold on it (each hold_stream is ended by one release_stream)");
    }
    if (--it->second.count > 0) return;
    const bool destroy = it->second.destroy_pending;
    holds_.erase(it);
    if (!destroy) return;
  }
  destroy_stream_now(stream);
}

void device::map_chunks(void* address, std::span<const sized_chunk> chunks) {
  auto at = reinterpret_cast<std::uintptr_t>(address);
  std::size_t mapped = 0;
  try {
    for (; mapped < chunks.size(); ++mapped) {
      map(reinterpret_cast<void*>(at), chunks[mapped].chunk);
      at += chunks[mapped].bytes;
    }
  } catch (...) {
    while (mapped > 0) {  // all or nothing: the ones mapped go again, last first
      at -= chunks[--mapped].bytes;
      try {
        unmap(reinterpret_cast<void*>(at));
      } catch (const error&) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
      }
    }
    throw;
  }
}

void device::grant_peer_access(int peer) {
  if (peer < 0 || peer == ordinal()) {
    throw invalid_argument(name() + ": grant_peer_access(" + std::to_string(peer) +
                           ") names no other device (a peer is another device's ordinal)");
  }
}

}  // namespace shoal::backend
