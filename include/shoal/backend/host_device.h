// The host backend: the device contract implemented with host memory.
//
// Segments and physical chunks are memfd files mapped with mmap, so they can
// be shared with other processes by fd; a reservation is a PROT_NONE range in
// which chunks are mapped with MAP_FIXED. Each stream is an in-order executor
// thread: work enqueued on it runs after the call returns, so the races a GPU
// allows happen here too. Events mark a point in a stream's sequence of work;
// a stream waiting on an event blocks its own executor until the other stream
// has passed that point.
//
// Across processes, each device has one event source: a shared page in which
// every stream keeps its completed count (4096 slots; a stream created while
// all are held by live streams cannot export_event, which then throws
// shoal::backend_error). A stream waiting on an imported point polls the
// exporter's count, napping at most half a millisecond between looks, and
// checks every 10 ms that the exporter lives (by pid and start time, so both
// processes must see one another's /proc). The wait fails with stream_error
// when the exporter dies before the point, or when it lives but has not
// passed the point within peer_wait_limit (a peer that stopped, or one that
// never advances its count: the page is its to write), so no stream, and no
// device's end waiting for a destroyed stream's work, waits on a peer forever.
//
// Thread-safety: as for every device, all members may be called concurrently.
// Invariant: used bytes (segments + live chunks) never exceed capacity_bytes;
// a request that would pass it throws shoal::out_of_memory.
#pragma once

#include <cstddef>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "shoal/backend/device.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::backend {

/// A test mode: a random pause before each piece of work on a stream, up to
/// `max` (at most max_lag), drawn from a generator seeded with `seed` and the
/// stream's number on its device (0 for the default stream, then in the
/// order streams are made: a run that makes its streams in the same order
/// pauses the same). A GPU starts work whenever it gets to it, where a host
/// stream starts it within microseconds, so on the host a missing wait shows
/// only where a test delays a stream on purpose; with a lag, anywhere.
struct host_stream_lag {
  static constexpr std::chrono::microseconds max_lag{1'000'000};
  std::chrono::microseconds max{0};
  std::uint64_t seed = 1;
};

struct host_device_options {
  /// Memory the device pretends to have. 0: half of the machine's memory.
  std::size_t capacity_bytes = 0;
  /// Unset: SHOAL_HOST_STREAM_LAG, "<max microseconds>[:<seed>]", when the
  /// environment has it and it is not empty (invalid_argument when it does
  /// not parse or passes max_lag), else none. A max past max_lag given here
  /// is invalid_argument too.
  std::optional<host_stream_lag> stream_lag;
  /// How long a stream waits on a point another process exported before the
  /// wait fails (stream_error), the exporter alive or not.
  std::chrono::milliseconds peer_wait_limit{std::chrono::minutes(2)};
};

namespace detail {
struct __attribute__((visibility("hidden"))) host_state;  // hidden: the library's own
}

class host_device final : public device {
 public:
  explicit host_device(host_device_options options = {});
  ~host_device() override;

  [[nodiscard]] device_kind kind() const noexcept override { return device_kind::host; }
  [[nodiscard]] int ordinal() const noexcept override { return 0; }
  [[nodiscard]] std::string name() const override { return "host"; }

  [[nodiscard]] memory_info memory() const override;
  void* allocate_segment(std::size_t bytes) override;
  void free_segment(void* base) override;
  void* allocate_pinned_host(std::size_t bytes) override;
  void free_pinned_host(void* base) override;

  /// Always supported and shareable: chunks are memfds.
  [[nodiscard]] growable_support growable() const noexcept override { return {.supported = true, .shareable = true}; }
  [[nodiscard]] std::size_t granularity() const noexcept override;
  void* reserve_range(std::size_t bytes) override;
  void release_range(void* base) override;
  physical_ref create_physical(std::size_t bytes) override;
  void release_physical(physical_ref chunk) override;
  void map(void* address, physical_ref chunk) override;
  void unmap(void* address) override;

  stream_ref create_stream() override;
  stream_ref adopt_external_stream(void* native) override;
  void synchronize(stream_ref stream) override;
  void synchronize_device() override;
  [[nodiscard]] bool query(stream_ref stream) override;

  event_ref create_event() override;
  void destroy_event(event_ref event) override;
  void record(event_ref event, stream_ref stream) override;
  [[nodiscard]] bool query_event(event_ref event) override;
  void synchronize_event(event_ref event) override;
  void wait(stream_ref stream, event_ref event) override;

  void copy(stream_ref stream, void* dst, const void* src, std::size_t bytes) override;
  void fill(stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) override;
  void delay(stream_ref stream, std::chrono::microseconds duration) override;
  void host_task(stream_ref stream, std::function<void()> task) override;

  [[nodiscard]] shareable_handle export_memory(const void* ptr) override;
  using device::import_memory;
  void* import_memory(std::span<const shareable_handle> chunks, memory_access access) override;
  void close_import(void* ptr) override;

  [[nodiscard]] event_point export_event(stream_ref stream) override;
  [[nodiscard]] event_source describe_event_source(std::uint64_t source_id) override;
  imported_event_ref open_event_source(const event_source& source) override;
  [[nodiscard]] std::optional<process_identity> event_source_exporter(imported_event_ref source) override;
  void wait_imported(stream_ref stream, imported_event_ref source, const event_point& point) override;
  void close_event_source(imported_event_ref source) override;

 protected:
  void destroy_stream_now(stream_ref stream) override;

 private:
  std::unique_ptr<detail::host_state> state_;
};

}  // namespace shoal::backend

#pragma GCC visibility pop
