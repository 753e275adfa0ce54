// shoal's caching allocator behind the common adapter face.
//
// Thread-safety: allocate and deallocate may be called from any thread at
// once (as caching_allocator's may); create_stream, destroy_stream and
// synchronize from one thread at a time, while no other call is running.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "bench/common/allocator_adapter.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/device.h"

namespace shoal::bench {

class shoal_adapter final : public allocator_adapter {
 public:
  shoal_adapter(backend::device& device, alloc::allocator_config config)
      : streams_{device}, allocator_(device, std::move(config)) {}

  [[nodiscard]] std::string name() const override { return "shoal"; }

  [[nodiscard]] void* create_stream() override {
    const backend::stream_ref stream = streams_.device.create_stream();
    streams_.live.push_back(stream);
    return stream.native;
  }

  void destroy_stream(void* stream) override {
    std::erase(streams_.live, backend::stream_ref{stream});
    streams_.device.destroy_stream(backend::stream_ref{stream});
  }

  [[nodiscard]] void* allocate(std::size_t bytes, void* stream) override {
    return allocator_.allocate(bytes, backend::stream_ref{stream});
  }

  void deallocate(void* ptr, std::size_t, void* stream) override {
    allocator_.deallocate(ptr, backend::stream_ref{stream});
  }

  [[nodiscard]] std::size_t reserved_bytes() const override {
    return static_cast<std::size_t>(allocator_.stats().reserved_bytes.aggregate.current);
  }

  [[nodiscard]] std::size_t peak_reserved_bytes() const override {
    return static_cast<std::size_t>(allocator_.stats().reserved_bytes.aggregate.peak);
  }

  [[nodiscard]] std::int64_t device_allocations() const override {
    return allocator_.stats().device_allocations;
  }

  [[nodiscard]] std::int64_t device_frees() const override { return allocator_.stats().device_frees; }

  [[nodiscard]] std::string vmm_calls() const override {
    const alloc::vmm_call_counts c = allocator_.stats().vmm_calls;
    if (c.total() == 0) return "-";
    return std::to_string(c.creates) + " / " + std::to_string(c.releases) + " / " + std::to_string(c.maps) + " / " +
           std::to_string(c.unmaps) + " / " + std::to_string(c.access_grants);
  }

  void synchronize() override {
    for (const backend::stream_ref stream : streams_.live) streams_.device.synchronize(stream);
  }

  /// The allocator itself, for what the common face does not cover
  /// (snapshots, requested bytes).
  [[nodiscard]] alloc::caching_allocator& allocator() noexcept { return allocator_; }

 private:
  // Declared before the allocator so that they outlive it: the allocator
  // may still use its blocks' streams while it returns its segments.
  struct owned_streams {
    explicit owned_streams(backend::device& d) : device(d) {}
    owned_streams(const owned_streams&) = delete;
    owned_streams& operator=(const owned_streams&) = delete;
    ~owned_streams() {
      for (const backend::stream_ref stream : live) device.destroy_stream(stream);
    }
    backend::device& device;
    std::vector<backend::stream_ref> live;
  };
  owned_streams streams_;
  alloc::caching_allocator allocator_;
};

}  // namespace shoal::bench
