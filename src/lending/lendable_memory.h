// One region's device memory on the lender's side: a physical chunk mapped in
// a reservation of its own, so it can be exported (CUDA VMM with a POSIX fd;
// a memfd on the host backend). Fresh memory for every region, so what one
// borrower wrote is never lent to another.
//
// Not thread-safe (owned by the lender's thread). The destructor unmaps and
// drops the lender's handle; the memory itself returns to the device once
// every borrower's mapping of it is gone too.
#pragma once

#include <cstddef>

#include "shoal/backend/device.h"
#include "shoal/backend/shareable_handle.h"

namespace shoal::lending::detail {

class lendable_memory {
 public:
  /// At least `bytes` (rounded up to the device's granularity). Throws the
  /// device's errors (out_of_memory when it has not that much).
  lendable_memory(backend::device& device, std::size_t bytes);
  ~lendable_memory();
  lendable_memory(const lendable_memory&) = delete;
  lendable_memory& operator=(const lendable_memory&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// A new handle (with its own descriptor) for a borrower to map.
  [[nodiscard]] backend::shareable_handle export_handle() const;

 private:
  backend::device& device_;
  std::size_t size_;
  void* base_ = nullptr;
  backend::physical_ref chunk_{};
};

/// `bytes` rounded up to a multiple of `granularity`; 0 when that overflows.
[[nodiscard]] std::size_t round_up(std::size_t bytes, std::size_t granularity) noexcept;

}  // namespace shoal::lending::detail
