// One face for every allocator the benchmarks compare: shoal's caching
// allocator, PyTorch's, cudaMallocAsync, RMM's resources. Each adapter makes
// its own streams, since allocators only accept streams they understand.
//
// Not thread-safe unless an adapter says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shoal::bench {

class allocator_adapter {
 public:
  virtual ~allocator_adapter() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  /// A new stream in the adapter's own terms (opaque to the caller).
  [[nodiscard]] virtual void* create_stream() = 0;
  virtual void destroy_stream(void* stream) = 0;
  [[nodiscard]] virtual void* allocate(std::size_t bytes, void* stream) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes, void* stream) = 0;
  /// Device memory the allocator holds now, and at most since creation.
  [[nodiscard]] virtual std::size_t reserved_bytes() const = 0;
  [[nodiscard]] virtual std::size_t peak_reserved_bytes() const = 0;
  /// Segments (or chunks) taken from and given back to the device since
  /// creation, where the allocator counts them; -1 where it does not.
  [[nodiscard]] virtual std::int64_t device_allocations() const { return -1; }
  [[nodiscard]] virtual std::int64_t device_frees() const { return -1; }
  /// The VMM calls among them, as "creates / releases / maps / unmaps /
  /// access grants", where the allocator counts them; "-" where it does not.
  [[nodiscard]] virtual std::string vmm_calls() const { return "-"; }
  /// Waits for all streams the adapter made.
  virtual void synchronize() = 0;
};

}  // namespace shoal::bench
