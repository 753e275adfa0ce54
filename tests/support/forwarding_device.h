// A device that passes every call to another device. A test derives from it
// and overrides the one member whose behaviour it needs to change (say, to
// hold a call until the test lets it go); everything else stays real.
#pragma once

#include "shoal/backend/device.h"

namespace shoal::testing {

class forwarding_device : public backend::device {
 public:
  /// Forwards to `target`, which must outlive this device.
  explicit forwarding_device(backend::device& target) : target_(target) {}

  [[nodiscard]] backend::device_kind kind() const noexcept override { return target_.kind(); }
  [[nodiscard]] int ordinal() const noexcept override { return target_.ordinal(); }
  [[nodiscard]] std::string name() const override { return target_.name(); }

  [[nodiscard]] backend::memory_info memory() const override { return target_.memory(); }
  void* allocate_segment(std::size_t bytes) override { return target_.allocate_segment(bytes); }
  void free_segment(void* base) override { target_.free_segment(base); }
  void* allocate_pinned_host(std::size_t bytes) override { return target_.allocate_pinned_host(bytes); }
  void free_pinned_host(void* base) override { target_.free_pinned_host(base); }

  [[nodiscard]] backend::growable_support growable() const noexcept override { return target_.growable(); }
  [[nodiscard]] std::size_t granularity() const noexcept override { return target_.granularity(); }
  void* reserve_range(std::size_t bytes) override { return target_.reserve_range(bytes); }
  void release_range(void* base) override { target_.release_range(base); }
  backend::physical_ref create_physical(std::size_t bytes) override { return target_.create_physical(bytes); }
  void release_physical(backend::physical_ref chunk) override { target_.release_physical(chunk); }
  void map(void* address, backend::physical_ref chunk) override { target_.map(address, chunk); }
  void map_chunks(void* address, std::span<const backend::sized_chunk> chunks) override {
    target_.map_chunks(address, chunks);
  }
  void unmap(void* address) override { target_.unmap(address); }

  backend::stream_ref create_stream() override { return target_.create_stream(); }
  backend::stream_ref adopt_external_stream(void* native) override { return target_.adopt_external_stream(native); }
  void synchronize(backend::stream_ref stream) override { target_.synchronize(stream); }
  void synchronize_device() override { target_.synchronize_device(); }
  [[nodiscard]] bool query(backend::stream_ref stream) override { return target_.query(stream); }

  backend::event_ref create_event() override { return target_.create_event(); }
  void destroy_event(backend::event_ref event) override { target_.destroy_event(event); }
  void record(backend::event_ref event, backend::stream_ref stream) override { target_.record(event, stream); }
  [[nodiscard]] bool query_event(backend::event_ref event) override { return target_.query_event(event); }
  void synchronize_event(backend::event_ref event) override { target_.synchronize_event(event); }
  void wait(backend::stream_ref stream, backend::event_ref event) override { target_.wait(stream, event); }

  void copy(backend::stream_ref stream, void* dst, const void* src, std::size_t bytes) override {
    target_.copy(stream, dst, src, bytes);
  }
  void fill(backend::stream_ref stream, void* dst, std::uint8_t value, std::size_t bytes) override {
    target_.fill(stream, dst, value, bytes);
  }
  void delay(backend::stream_ref stream, std::chrono::microseconds duration) override { target_.delay(stream, duration); }
  void host_task(backend::stream_ref stream, std::function<void()> task) override {
    target_.host_task(stream, std::move(task));
  }

  [[nodiscard]] backend::shareable_handle export_memory(const void* ptr) override { return target_.export_memory(ptr); }
  using device::import_memory;
  void* import_memory(std::span<const backend::shareable_handle> chunks, backend::memory_access access) override {
    return target_.import_memory(chunks, access);
  }
  void close_import(void* ptr) override { target_.close_import(ptr); }

  [[nodiscard]] backend::event_point export_event(backend::stream_ref stream) override {
    return target_.export_event(stream);
  }
  [[nodiscard]] backend::event_source describe_event_source(std::uint64_t source_id) override {
    return target_.describe_event_source(source_id);
  }
  backend::imported_event_ref open_event_source(const backend::event_source& source) override {
    return target_.open_event_source(source);
  }
  [[nodiscard]] std::optional<process_identity> event_source_exporter(backend::imported_event_ref source) override {
    return target_.event_source_exporter(source);
  }
  void wait_imported(backend::stream_ref stream, backend::imported_event_ref source,
                     const backend::event_point& point) override {
    target_.wait_imported(stream, source, point);
  }
  void close_event_source(backend::imported_event_ref source) override { target_.close_event_source(source); }

 protected:
  void destroy_stream_now(backend::stream_ref stream) override { target_.destroy_stream(stream); }

 private:
  backend::device& target_;
};

}  // namespace shoal::testing
