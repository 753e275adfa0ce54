// A device that reports the growable_support a test chooses in place of its
// target's, and counts the segment calls the allocator makes: plain segments
// (allocate_segment, free_segment) and growable ones (reserve_range,
// create_physical, map, map_chunks). Reporting no support, it behaves as a CUDA device
// without virtual memory management does: the growable calls throw
// shoal::backend_error (and are counted all the same). Everything else is the
// real device's. Counters are atomic.
#pragma once

#include <atomic>

#include "shoal/core/error.h"
#include "support/forwarding_device.h"

namespace shoal::testing {

class growable_support_device : public forwarding_device {
 public:
  /// Forwards to `target`, which must outlive this device, reporting `support`.
  growable_support_device(backend::device& target, backend::growable_support support)
      : forwarding_device(target), support_(support) {}

  [[nodiscard]] backend::growable_support growable() const noexcept override { return support_; }

  void* allocate_segment(std::size_t bytes) override {
    ++plain_allocations;
    return forwarding_device::allocate_segment(bytes);
  }
  void free_segment(void* base) override {
    ++plain_frees;
    forwarding_device::free_segment(base);
  }
  void* reserve_range(std::size_t bytes) override {
    growable_call("reserve_range");
    return forwarding_device::reserve_range(bytes);
  }
  backend::physical_ref create_physical(std::size_t bytes) override {
    growable_call("create_physical");
    return forwarding_device::create_physical(bytes);
  }
  void map(void* address, backend::physical_ref chunk) override {
    growable_call("map");
    forwarding_device::map(address, chunk);
  }
  void map_chunks(void* address, std::span<const backend::sized_chunk> chunks) override {
    growable_call("map_chunks");
    forwarding_device::map_chunks(address, chunks);
  }

  std::atomic<int> plain_allocations{0};
  std::atomic<int> plain_frees{0};
  std::atomic<int> growable_calls{0};

 private:
  void growable_call(const char* op) {
    ++growable_calls;
    if (!support_.supported) throw backend_error(op, "no growable ranges on this device (the test says so)");
  }

  const backend::growable_support support_;
};

}  // namespace shoal::testing
