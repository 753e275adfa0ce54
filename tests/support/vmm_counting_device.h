// A device that counts the growable-range calls the allocator makes —
// chunks created and released, single maps, map_chunks calls and the chunks
// they map, unmaps — and can refuse to create chunks (out_of_memory), as a
// full GPU does. Everything else is the real device's. Counters are atomic.
#pragma once

#include <atomic>
#include <cstddef>

#include "shoal/core/error.h"
#include "support/forwarding_device.h"

namespace shoal::testing {

class vmm_counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;

  backend::physical_ref create_physical(std::size_t bytes) override {
    if (refuse_creates) throw out_of_memory("vmm_counting_device: the test refuses new chunks", bytes);
    ++creates;
    return forwarding_device::create_physical(bytes);
  }
  void release_physical(backend::physical_ref chunk) override {
    ++releases;
    forwarding_device::release_physical(chunk);
  }
  void map(void* address, backend::physical_ref chunk) override {
    ++single_maps;
    forwarding_device::map(address, chunk);
  }
  void map_chunks(void* address, std::span<const backend::sized_chunk> chunks) override {
    ++map_chunks_calls;
    chunks_mapped += static_cast<int>(chunks.size());
    forwarding_device::map_chunks(address, chunks);
  }
  void unmap(void* address) override {
    ++unmaps;
    forwarding_device::unmap(address);
  }

  /// Physical chunks created and not yet released.
  [[nodiscard]] int live_chunks() const noexcept { return creates - releases; }

  std::atomic<bool> refuse_creates{false};
  std::atomic<int> creates{0}, releases{0}, single_maps{0}, map_chunks_calls{0}, chunks_mapped{0}, unmaps{0};
};

}  // namespace shoal::testing
