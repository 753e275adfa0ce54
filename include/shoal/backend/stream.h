// Owning wrappers for streams and events, and the per-thread current stream.
//
// `stream` and `event` destroy what they own exactly once (move-only).
// The current stream is per thread and per device: it starts as the device's
// default stream, `stream_guard` sets it for a scope and restores the previous
// one. Upper layers (the allocator's free) read it to know which stream the
// caller works on. The current-stream functions are thread-safe because each
// thread has its own slot; a `stream` or `event` object is used by one thread
// at a time like any value.
#pragma once

#include <utility>

#include "shoal/backend/device.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::backend {

class stream {
 public:
  /// Creates a new stream on `dev`.
  explicit stream(device& dev) : device_(&dev), ref_(dev.create_stream()) {}
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  stream(stream&& other) noexcept : device_(other.device_), ref_(std::exchange(other.ref_, {})) {
    other.device_ = nullptr;
  }
  stream& operator=(stream&& other) noexcept;
  ~stream() { reset(); }

  [[nodiscard]] stream_ref ref() const noexcept { return ref_; }
  operator stream_ref() const noexcept { return ref_; }  // NOLINT: a stream is usable wherever its ref is
  [[nodiscard]] device& owner() const noexcept { return *device_; }
  void synchronize() { device_->synchronize(ref_); }

 private:
  void reset() noexcept;
  device* device_;
  stream_ref ref_;
};

class event {
 public:
  explicit event(device& dev) : device_(&dev), ref_(dev.create_event()) {}
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  event(event&& other) noexcept : device_(other.device_), ref_(std::exchange(other.ref_, {})) {
    other.device_ = nullptr;
  }
  event& operator=(event&& other) noexcept;
  ~event() { reset(); }

  [[nodiscard]] event_ref ref() const noexcept { return ref_; }
  operator event_ref() const noexcept { return ref_; }  // NOLINT: as for stream
  void record(stream_ref on) { device_->record(ref_, on); }
  [[nodiscard]] bool query() { return device_->query_event(ref_); }
  void synchronize() { device_->synchronize_event(ref_); }

 private:
  void reset() noexcept;
  device* device_;
  event_ref ref_;
};

/// The calling thread's current stream on `dev` (the default stream unless a
/// stream_guard says otherwise).
[[nodiscard]] stream_ref current_stream(const device& dev) noexcept;

/// Makes `s` the calling thread's current stream on `dev` until destroyed,
/// then restores the previous one. Guards nest; destroy them in reverse order.
class stream_guard {
 public:
  stream_guard(const device& dev, stream_ref s);
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  ~stream_guard();

 private:
  const device& device_;
  stream_ref previous_;
};

}  // namespace shoal::backend

#pragma GCC visibility pop
