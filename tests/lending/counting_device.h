// A device that counts the calls memory reuse and prepared chunks are meant
// to save: chunks made (the lender's create_physical) and exported
// (export_memory), imports (a borrower's import_memory), and the imports
// closed (a kept mapping dropped). Everything else is the
// real device's. Counters are atomic: the lender calls from its thread.
#pragma once

#include <atomic>

#include "support/forwarding_device.h"

namespace shoal::testing {

class counting_device : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  using forwarding_device::import_memory;

  backend::physical_ref create_physical(std::size_t bytes) override {
    ++chunks_made;
    return forwarding_device::create_physical(bytes);
  }
  backend::shareable_handle export_memory(const void* ptr) override {
    ++exports;
    return forwarding_device::export_memory(ptr);
  }
  void* import_memory(std::span<const backend::shareable_handle> chunks, backend::memory_access access) override {
    ++imports;
    return forwarding_device::import_memory(chunks, access);
  }
  void close_import(void* ptr) override {
    ++imports_closed;
    forwarding_device::close_import(ptr);
  }

  std::atomic<int> chunks_made{0};
  std::atomic<int> exports{0};
  std::atomic<int> imports{0};
  std::atomic<int> imports_closed{0};
};

}  // namespace shoal::testing
