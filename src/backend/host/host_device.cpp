#include "shoal/backend/host_device.h"

#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend/host/host_event_page.h"
#include "backend/host/host_executor.h"
#include "backend/host/host_memory.h"
#include "core/address_text.h"
#include "core/fork_epoch.h"
#include "shoal/core/error.h"

namespace shoal::backend {

namespace detail {

// An event is a point (ticket) in one stream; unrecorded events point nowhere.
struct host_event {
  std::mutex mutex;
  std::shared_ptr<host_executor> stream;  // guarded by mutex
  std::uint64_t ticket = 0;               // guarded by mutex
};

// Where an event was last recorded, copied out of it.
struct recorded_point {
  std::shared_ptr<host_executor> stream;
  std::uint64_t ticket = 0;
  [[nodiscard]] bool passed() const { return !stream || stream->completed() >= ticket; }
};

struct host_state {
  host_state(std::size_t capacity, host_stream_lag lag, std::chrono::milliseconds peer_wait_limit)
      : lag(lag),
        peer_wait_limit(peer_wait_limit),
        memory(capacity),
        event_page(host_event_page::create()),
        default_stream(std::make_shared<host_executor>(event_page->lease(), lag, 0)) {}
  host_state(const host_state&) = delete;
  host_state& operator=(const host_state&) = delete;
  // The work destroyed streams still run may write this device's memory,
  // which goes with it. (A fork() child runs none of it.) A wait on another
  // process's point in that work ends by peer_wait_limit at the latest.
  ~host_state() {
    if (epoch.forked_since()) return;
    for (const auto& executor : destroyed_streams) executor->wait_for(executor->submitted());
  }

  // Streams made in a fork() child would take slots of the parent's
  // shared event page, and its memory no stream there could use: a child
  // may make neither (refuse_in_fork_child).
  const shoal::detail::fork_epoch epoch;
  const host_stream_lag lag;  // every stream's, the default stream's too
  const std::chrono::milliseconds peer_wait_limit;  // waits on imported points
  std::atomic<std::uint64_t> streams_made{0};  // numbers the streams for their lag (the default one is 0)
  host_memory memory;
  // Where every stream publishes its progress for other processes; streams
  // created when all its slots are taken keep theirs private.
  std::shared_ptr<host_event_page> event_page;
  std::shared_ptr<host_executor> default_stream;
  // Streams, events and imported sources are looked up here on every use,
  // so a destroyed or foreign reference gives invalid_argument instead of a
  // crash. Executors are shared with the events recorded on them, which may
  // outlive them; imported pages with the waits enqueued on them.
  std::shared_mutex registry_mutex;
  std::unordered_map<void*, std::shared_ptr<host_executor>> streams;
  std::unordered_map<void*, std::unique_ptr<host_event>> events;
  std::unordered_map<void*, std::shared_ptr<host_imported_page>> imported_sources;
  // Destroyed streams' executors, whose detached threads run their queued
  // work out: kept until it ran, so that synchronize_device and the
  // device's end wait for it (it may write the device's memory), while a
  // destroy returns at once, as CUDA's does, and no owner joins a thread
  // whose work waits for it (a stream waiting on another's event, a task
  // holding its own stream, a wait for another process's stream). Drained
  // ones are dropped at the next create_stream or destroy_stream.
  std::vector<std::shared_ptr<host_executor>> destroyed_streams;

  // With registry_mutex held. A drained executor's thread (detached) runs
  // nothing more that touches the device.
  void drop_drained_destroyed_streams() {
    std::erase_if(destroyed_streams, [](const auto& e) { return e->completed() >= e->submitted(); });
  }

  // device_unavailable in a fork() child of the process that opened the device.
  void refuse_in_fork_child(const char* what) const {
    if (epoch.forked_since()) host_executor::throw_forked(what);
  }

  // The look-ups below refuse in a fork() child before the registry's lock,
  // which another of the parent's threads may have held at the fork.
  std::shared_ptr<host_executor> find(stream_ref s) {
    if (s.is_default()) return default_stream;
    refuse_in_fork_child("use a stream");
    std::shared_lock lock(registry_mutex);
    const auto it = streams.find(s.native);
    if (it == streams.end()) throw invalid_argument("stream " + shoal::detail::hex(s.native) + " is not a live stream of this host device");
    return it->second;
  }

  recorded_point point_of(event_ref e) {
    refuse_in_fork_child("use an event");
    std::shared_lock lock(registry_mutex);
    host_event& ev = find_locked(e);
    std::lock_guard event_lock(ev.mutex);
    return {ev.stream, ev.ticket};
  }

  std::shared_ptr<host_imported_page> find(imported_event_ref source) {
    refuse_in_fork_child("use an imported event source");
    std::shared_lock lock(registry_mutex);
    const auto it = imported_sources.find(source.native);
    if (it == imported_sources.end()) {
      throw invalid_argument("imported event source " + shoal::detail::hex(source.native) +
                             " is not open on this host device (closed already, or opened by another device)");
    }
    return it->second;
  }

  host_event& find_locked(event_ref e) {
    const auto it = events.find(e.native);
    if (it == events.end()) throw invalid_argument("event " + shoal::detail::hex(e.native) + " is not a live event of this host device");
    return *it->second;
  }
};

namespace {

std::size_t default_capacity() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::size_t{4} << 30;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 2;
}

void require_pointers(const char* op, const void* a, const void* b, std::size_t bytes) {
  if (bytes > 0 && (a == nullptr || b == nullptr)) {
    throw invalid_argument(std::string(op) + ": null pointer with " + std::to_string(bytes) + " bytes to move");
  }
}

}  // namespace
}  // namespace detail

namespace {

// SHOAL_HOST_STREAM_LAG: "<max microseconds>[:<seed>]"; none when unset.
host_stream_lag lag_from_environment() {
  const char* text = std::getenv("SHOAL_HOST_STREAM_LAG");
  if (text == nullptr || *text == '\0') return {};
  const std::string_view value(text);
  host_stream_lag lag;
  std::int64_t max_us = 0;
  const char* end = value.data() + value.size();
  std::from_chars_result read = std::from_chars(value.data(), end, max_us);
  if (read.ec == std::errc() && read.ptr != end && *read.ptr == ':') read = std::from_chars(read.ptr + 1, end, lag.seed);
  if (read.ec != std::errc() || read.ptr != end || max_us < 0 || max_us > host_stream_lag::max_lag.count()) {
    throw invalid_argument("host_device: SHOAL_HOST_STREAM_LAG='" + std::string(value) +
                           "' is not '<max microseconds>[:<seed>]' with a max of at most " +
                           std::to_string(host_stream_lag::max_lag.count()) + " (say 200 or 200:7)");
  }
  lag.max = std::chrono::microseconds(max_us);
  return lag;
}

host_stream_lag checked(const host_stream_lag& lag) {
  if (lag.max > host_stream_lag::max_lag) {
    throw invalid_argument("host_device: a stream lag of " + std::to_string(lag.max.count()) +
                           " microseconds passes the most allowed, " +
                           std::to_string(host_stream_lag::max_lag.count()));
  }
  return lag;
}

std::chrono::milliseconds checked_peer_wait_limit(std::chrono::milliseconds limit) {
  if (limit.count() <= 0) {
    throw invalid_argument("host_device: a peer wait limit of " + std::to_string(limit.count()) +
                           " ms; give a positive one (a wait on another process always has a deadline)");
  }
  return limit;
}

}  // namespace

host_device::host_device(host_device_options options)
    : state_(std::make_unique<detail::host_state>(
          options.capacity_bytes != 0 ? options.capacity_bytes : detail::default_capacity(),
          options.stream_lag ? checked(*options.stream_lag) : lag_from_environment(),
          checked_peer_wait_limit(options.peer_wait_limit))) {}

host_device::~host_device() = default;

memory_info host_device::memory() const { return state_->memory.info(); }
// Memory of the device in a fork() child would be usable by no stream there
// (and counted against the parent's capacity): refused, as streams are.
void* host_device::allocate_segment(std::size_t bytes) {
  state_->refuse_in_fork_child("allocate memory");
  return state_->memory.allocate_segment(bytes);
}
void host_device::free_segment(void* base) { state_->memory.free_segment(base); }
void* host_device::allocate_pinned_host(std::size_t bytes) {
  state_->refuse_in_fork_child("allocate pinned memory");
  return state_->memory.allocate_pinned_host(bytes);
}
void host_device::free_pinned_host(void* base) { state_->memory.free_pinned_host(base); }

std::size_t host_device::granularity() const noexcept { return detail::host_memory::chunk_granularity; }
void* host_device::reserve_range(std::size_t bytes) {
  state_->refuse_in_fork_child("reserve an address range");
  return state_->memory.reserve_range(bytes);
}
void host_device::release_range(void* base) { state_->memory.release_range(base); }
physical_ref host_device::create_physical(std::size_t bytes) {
  state_->refuse_in_fork_child("allocate memory");
  return state_->memory.create_physical(bytes);
}
void host_device::release_physical(physical_ref chunk) { state_->memory.release_physical(chunk); }
void host_device::map(void* address, physical_ref chunk) { state_->memory.map(address, chunk); }
void host_device::unmap(void* address) { state_->memory.unmap(address); }

stream_ref host_device::create_stream() {
  state_->refuse_in_fork_child("create a stream");
  {
    std::unique_lock lock(state_->registry_mutex);
    state_->drop_drained_destroyed_streams();  // their event page slots go back first
  }
  auto executor = std::make_shared<detail::host_executor>(
      state_->event_page->lease(), state_->lag, state_->streams_made.fetch_add(1, std::memory_order_relaxed) + 1);
  void* key = executor.get();
  std::unique_lock lock(state_->registry_mutex);
  state_->streams.emplace(key, std::move(executor));
  return stream_ref{key};
}

void host_device::destroy_stream_now(stream_ref s) {
  if (state_->epoch.forked_since()) return;  // a fork() child's drop: the stream is the parent's
  std::shared_ptr<detail::host_executor> executor;
  {
    std::unique_lock lock(state_->registry_mutex);
    const auto it = state_->streams.find(s.native);
    if (it == state_->streams.end()) {
      throw invalid_argument("destroy_stream: " + shoal::detail::hex(s.native) +
                             " is not a live stream of this host device (destroyed already?)");
    }
    state_->drop_drained_destroyed_streams();
    state_->destroyed_streams.emplace_back(it->second);  // first: nothing changes if this throws
    executor = std::move(it->second);
    state_->streams.erase(it);
  }
  // Its thread ends once the work queued has run, though events recorded
  // here keep the executor (their count) alive: a stream per request leaves
  // no thread behind in the event pools of an allocator.
  executor->stop_when_drained();
}

stream_ref host_device::adopt_external_stream(void* native) {
  if (native == nullptr) return stream_ref{};
  state_->refuse_in_fork_child("adopt a stream");
  std::shared_lock lock(state_->registry_mutex);
  if (!state_->streams.contains(native)) {
    throw invalid_argument("adopt_external_stream: " + shoal::detail::hex(native) +
                           " is not a stream of this host device (the host backend has no foreign streams)");
  }
  return stream_ref{native};
}

void host_device::synchronize(stream_ref s) {
  const auto executor = state_->find(s);
  executor->wait_for(executor->submitted());
  if (std::string failure = executor->take_error(); !failure.empty()) {
    throw stream_error("work on a host stream failed: " + failure);
  }
}

void host_device::synchronize_device() {
  state_->refuse_in_fork_child("wait for the device");
  std::vector<std::shared_ptr<detail::host_executor>> executors{state_->default_stream};
  {
    std::shared_lock lock(state_->registry_mutex);
    for (const auto& [native, executor] : state_->streams) executors.push_back(executor);
    executors.insert(executors.end(), state_->destroyed_streams.begin(), state_->destroyed_streams.end());
  }
  // Waited for without the lock, so waiting never blocks other streams' calls.
  for (const auto& executor : executors) executor->wait_for(executor->submitted());
}

bool host_device::query(stream_ref s) {
  const auto executor = state_->find(s);
  return executor->completed() >= executor->submitted();
}

event_ref host_device::create_event() {
  state_->refuse_in_fork_child("create an event");
  auto ev = std::make_unique<detail::host_event>();
  void* key = ev.get();
  std::unique_lock lock(state_->registry_mutex);
  state_->events.emplace(key, std::move(ev));
  return event_ref{key};
}

void host_device::destroy_event(event_ref e) {
  if (state_->epoch.forked_since()) return;  // a fork() child's drop: the event is the parent's
  std::unique_lock lock(state_->registry_mutex);
  if (state_->events.erase(e.native) == 0) {
    throw invalid_argument("destroy_event: " + shoal::detail::hex(e.native) +
                           " is not a live event of this host device (destroyed already?)");
  }
}

void host_device::record(event_ref e, stream_ref s) {
  state_->refuse_in_fork_child("record an event");
  auto executor = state_->find(s);
  std::shared_lock lock(state_->registry_mutex);
  detail::host_event& ev = state_->find_locked(e);
  std::lock_guard event_lock(ev.mutex);
  ev.ticket = executor->submitted();
  ev.stream = std::move(executor);
}

bool host_device::query_event(event_ref e) { return state_->point_of(e).passed(); }

void host_device::synchronize_event(event_ref e) {
  const detail::recorded_point point = state_->point_of(e);
  if (point.stream) point.stream->wait_for(point.ticket);
}

void host_device::wait(stream_ref s, event_ref e) {
  const auto waiter = state_->find(s);
  detail::recorded_point point = state_->point_of(e);
  if (point.passed() || point.stream == waiter) return;  // nothing to wait for; same stream is already ordered
  waiter->submit([point = std::move(point)] { point.stream->wait_for(point.ticket); });
}

void host_device::copy(stream_ref s, void* dst, const void* src, std::size_t bytes) {
  detail::require_pointers("copy", dst, src, bytes);
  if (bytes == 0) return;
  state_->find(s)->submit([=] { std::memmove(dst, src, bytes); });
}

void host_device::fill(stream_ref s, void* dst, std::uint8_t value, std::size_t bytes) {
  detail::require_pointers("fill", dst, dst, bytes);
  if (bytes == 0) return;
  state_->find(s)->submit([=] { std::memset(dst, value, bytes); });
}

void host_device::delay(stream_ref s, std::chrono::microseconds duration) {
  state_->find(s)->submit([=] { std::this_thread::sleep_for(duration); });
}

void host_device::host_task(stream_ref s, std::function<void()> task) {
  if (!task) throw invalid_argument("host_task: the task is empty");
  state_->find(s)->submit(std::move(task));
}

shareable_handle host_device::export_memory(const void* ptr) { return state_->memory.export_memory(ptr); }
void* host_device::import_memory(std::span<const shareable_handle> chunks, memory_access access) {
  return state_->memory.import_memory(chunks, access);
}
void host_device::close_import(void* ptr) { state_->memory.close_import(ptr); }

event_point host_device::export_event(stream_ref s) {
  const auto executor = state_->find(s);
  const detail::host_stream_slot* slot = executor->slot();
  if (slot == nullptr) {
    throw backend_error("export_event", "this host stream has no slot in the device's event page: all " +
                                            std::to_string(detail::host_event_page::slot_count) +
                                            " were held by live streams when it was created; export from a stream "
                                            "created after some of those are destroyed");
  }
  return event_point{slot->source_id(), slot->index(), executor->submitted()};
}

event_source host_device::describe_event_source(std::uint64_t source_id) {
  if (source_id != state_->event_page->source_id()) {
    throw invalid_argument("describe_event_source: " + std::to_string(source_id) +
                           " is not an event source of this host device (its one source is " +
                           std::to_string(state_->event_page->source_id()) + ")");
  }
  event_source source;
  source.kind = event_source_kind::host_page;
  source.device = device_kind::host;
  source.source_id = source_id;
  source.fd = state_->event_page->share();
  return source;
}

imported_event_ref host_device::open_event_source(const event_source& source) {
  state_->refuse_in_fork_child("open an event source");
  auto page = std::make_shared<detail::host_imported_page>(source);
  void* key = page.get();
  std::unique_lock lock(state_->registry_mutex);
  state_->imported_sources.emplace(key, std::move(page));
  return imported_event_ref{key};
}

std::optional<process_identity> host_device::event_source_exporter(imported_event_ref source) {
  return state_->find(source)->exporter();
}

void host_device::wait_imported(stream_ref s, imported_event_ref source, const event_point& point) {
  const auto waiter = state_->find(s);
  auto page = state_->find(source);
  page->check(point);
  if (page->passed(point)) return;
  // The wait holds the page: closing the source does not unmap it under the wait.
  waiter->submit([page = std::move(page), point, limit = state_->peer_wait_limit] {
    page->wait_until_passed(point, limit);
  });
}

void host_device::close_event_source(imported_event_ref source) {
  if (state_->epoch.forked_since()) return;  // a fork() child's drop: the source is the parent's
  std::unique_lock lock(state_->registry_mutex);
  if (state_->imported_sources.erase(source.native) == 0) {
    throw invalid_argument("close_event_source: " + shoal::detail::hex(source.native) +
                           " is not an event source open on this host device (closed already?)");
  }
}

}  // namespace shoal::backend
