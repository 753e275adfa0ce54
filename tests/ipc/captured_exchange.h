// What the sharing tests that play a hostile peer share: a connected pair of
// channels in this process, and a producer and a consumer (host backend, no
// background collector) whose frames can be captured, altered and replayed.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "shoal/ipc/sharing.h"

namespace shoal::testing {

// Message types of the sharing protocol (src/ipc/messages.h).
inline constexpr std::uint16_t counter_file_type = 1, segment_type = 2, event_source_type = 3, storage_type = 4,
                                retire_segments_type = 5, note_type = 7;

/// Two connected channel ends in this process; each takes the other's
/// shared ring, as a peer's does, so a test reading a peer's frames raw
/// reads them whichever way they came.
inline std::pair<channel::connection, channel::connection> connected_pair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) throw std::runtime_error("socketpair");
  std::pair<channel::connection, channel::connection> ends{channel::connection::adopt(unique_fd(fds[0]), {}, 1 << 20),
                                                           channel::connection::adopt(unique_fd(fds[1]), {}, 1 << 20)};
  ends.first.allow_peer_ring();
  ends.second.allow_peer_ring();
  return ends;
}

/// A producer and a consumer in this process; the producer's frames are
/// captured so a test can alter them before the consumer reads them.
struct captured_exchange {
  explicit captured_exchange(ipc::sharing_options consumer_options = {.collect_interval = std::chrono::milliseconds(0)})
      : consumer(consumer_allocator, consumer_options) {}

  backend::device& dev = backend::host_device_instance();
  alloc::caching_allocator producer_allocator{dev, {}};
  alloc::caching_allocator consumer_allocator{dev, {}};
  ipc::sharing_context producer{producer_allocator, {.collect_interval = std::chrono::milliseconds(0)}};
  ipc::sharing_context consumer;

  /// The frames of one real share of `bytes` (hello, counter file, segment,
  /// storage), with their descriptors. With `busy_stream`, the send stream
  /// still has work queued when the storage goes, so the storage message
  /// carries a point to wait for and its event source is announced first.
  std::vector<channel::frame> capture_share(std::size_t bytes, bool busy_stream = false) {
    auto [to_capture, capture] = connected_pair();
    ipc::peer sender(producer, std::move(to_capture));
    std::atomic<bool> sent{false};
    if (busy_stream) {
      dev.host_task({}, [&sent] {
        while (!sent.load()) std::this_thread::yield();
      });
    }
    sender.send(storage::storage::allocate(producer_allocator, bytes, {}), {}, {});
    sent.store(true);
    dev.synchronize({});
    std::vector<channel::frame> frames;
    do {
      frames.push_back(capture.receive());
    } while (frames.back().type != storage_type);
    return frames;
  }

  /// Replays `frames` to a fresh consumer peer, then returns `receive(peer)`
  /// (the peer goes when it returns).
  template <typename Receive>
  auto replay_then(const std::vector<channel::frame>& frames, Receive receive) {
    auto [from, to] = connected_pair();
    ipc::peer receiver(consumer, std::move(to));
    for (const auto& f : frames) from.send(f.type, f.payload, f.fd ? f.fd.get() : -1);
    return receive(receiver);
  }

  /// Replays `frames` to a fresh consumer peer and receives once.
  ipc::received replay(const std::vector<channel::frame>& frames) {
    return replay_then(frames, [](ipc::peer& receiver) { return receiver.receive({}); });
  }

  /// The protocol error a replay of `frames` ends in, or "accepted".
  std::string refusal_of(const std::vector<channel::frame>& frames) {
    try {
      (void)replay(frames);
    } catch (const protocol_error& e) {
      return e.what();
    }
    return "accepted";
  }
};

/// The first frame of `type` in `frames`.
inline channel::frame& frame_of_type(std::vector<channel::frame>& frames, std::uint16_t type) {
  for (auto& f : frames) {
    if (f.type == type) return f;
  }
  throw std::runtime_error("no frame of type " + std::to_string(type));
}

}  // namespace shoal::testing
