// Each call of the device contract, handed to the part of the CUDA device
// that owns it (cuda_device.h). The calls that need two parts (a stream and
// its interprocess event) are composed here, taking the stream registry's
// lock first as the lock order says.
#include "backend/cuda/cuda_device.h"

#include <utility>

#include "backend/cuda/cuda_current_device.h"

namespace shoal::backend::detail {

// ---- memory --------------------------------------------------------------------

memory_info cuda_device::memory() const { return memory_.info(); }
void* cuda_device::allocate_segment(std::size_t bytes) { return memory_.allocate_segment(bytes); }
void cuda_device::free_segment(void* base) { memory_.free_segment(base); }
void* cuda_device::allocate_pinned_host(std::size_t bytes) { return memory_.allocate_pinned_host(bytes); }
void cuda_device::free_pinned_host(void* base) { memory_.free_pinned_host(base); }

void* cuda_device::reserve_range(std::size_t bytes) { return memory_.reserve_range(bytes); }
void cuda_device::release_range(void* base) { memory_.release_range(base); }
physical_ref cuda_device::create_physical(std::size_t bytes) { return memory_.create_physical(bytes); }
void cuda_device::release_physical(physical_ref chunk) { memory_.release_physical(chunk); }
void cuda_device::map(void* address, physical_ref chunk) { memory_.map(address, chunk); }
void cuda_device::map_chunks(void* address, std::span<const sized_chunk> chunks) {
  memory_.map_chunks(address, chunks);
}
void cuda_device::unmap(void* address) { memory_.unmap(address); }
void cuda_device::grant_peer_access(int peer) { memory_.grant_peer_access(peer); }

shareable_handle cuda_device::export_memory(const void* ptr) { return memory_.export_memory(ptr); }
void* cuda_device::import_memory(std::span<const shareable_handle> chunks, memory_access access) {
  return memory_.import_memory(chunks, access);
}
void cuda_device::close_import(void* ptr) { memory_.close_import(ptr); }

// ---- streams and events ----------------------------------------------------------

stream_ref cuda_device::create_stream() { return streams_.create_stream(); }
stream_ref cuda_device::adopt_external_stream(void* native) { return streams_.adopt_external_stream(native); }

void cuda_device::destroy_stream_now(stream_ref stream) {
  streams_.destroy_stream(stream, [this](cudaStream_t native) { sharing_.forget_stream(native); });
}

void cuda_device::synchronize(stream_ref stream) { streams_.synchronize(stream); }
void cuda_device::synchronize_device() { streams_.synchronize_device(); }
bool cuda_device::query(stream_ref stream) { return streams_.query(stream); }

event_ref cuda_device::create_event() { return streams_.create_event(); }
void cuda_device::destroy_event(event_ref event) { streams_.destroy_event(event); }
void cuda_device::record(event_ref event, stream_ref stream) { streams_.record(event, stream); }
bool cuda_device::query_event(event_ref event) { return streams_.query_event(event); }
void cuda_device::synchronize_event(event_ref event) { streams_.synchronize_event(event); }
void cuda_device::wait(stream_ref stream, event_ref event) { streams_.wait(stream, event); }

void cuda_device::copy(stream_ref stream, void* dst, const void* src, std::size_t bytes) {
  streams_.copy(stream, dst, src, bytes);
}
void cuda_device::fill(stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) {
  streams_.fill(stream, dst, value, bytes);
}
void cuda_device::delay(stream_ref stream, std::chrono::microseconds duration) { streams_.delay(stream, duration); }
void cuda_device::host_task(stream_ref stream, std::function<void()> task) {
  streams_.host_task(stream, std::move(task));
}

// ---- ordering across processes ---------------------------------------------------------

event_point cuda_device::export_event(stream_ref stream) {
  const device_scope on_device(ordinal_);
  const auto s = streams_.lock_stream(stream, "export_event");  // held: the stream lives through the export
  return sharing_.export_event(s.native);
}

event_source cuda_device::describe_event_source(std::uint64_t source_id) {
  return sharing_.describe_event_source(source_id);
}

imported_event_ref cuda_device::open_event_source(const event_source& source) {
  return sharing_.open_event_source(source);
}

std::optional<process_identity> cuda_device::event_source_exporter(imported_event_ref source) {
  sharing_.check_imported(source);
  return std::nullopt;  // an interprocess event handle names no process
}

void cuda_device::wait_imported(stream_ref stream, imported_event_ref source, const event_point& point) {
  const device_scope on_device(ordinal_);
  const auto s = streams_.lock_stream(stream, "wait_imported");  // held: the stream lives through the wait
  sharing_.wait_imported(s.native, source, point);
}

void cuda_device::close_event_source(imported_event_ref source) { sharing_.close_event_source(source); }

}  // namespace shoal::backend::detail
