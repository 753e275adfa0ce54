// One chunk of device memory on the lender's side: a physical chunk mapped in
// a reservation of its own and exported once (CUDA VMM with a POSIX fd; a
// memfd on the host backend). The lender lends it to a region, and — when
// reuse allows (lender_config::reuse) — to later regions of the same size
// and borrower uid; its id names it to borrowers, who may keep it mapped.
//
// Not thread-safe (owned by the lender's thread). The destructor unmaps and
// drops the lender's handle; the memory itself returns to the device once
// every borrower's mapping of it is gone too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shoal/backend/device.h"
#include "shoal/backend/shareable_handle.h"

namespace shoal::lending::detail {

class lendable_memory {
 public:
  /// `bytes` (a multiple of the device's granularity), named `id` (> 0).
  /// Throws the device's errors (out_of_memory when it has not that much).
  lendable_memory(backend::device& device, std::size_t bytes, std::uint64_t id);
  ~lendable_memory();
  lendable_memory(const lendable_memory&) = delete;
  lendable_memory& operator=(const lendable_memory&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  /// The handle exported once, at construction: sending it again sends a
  /// duplicate of its descriptor (SCM_RIGHTS), so every lend reuses it.
  [[nodiscard]] const backend::shareable_handle& handle() const noexcept { return handle_; }

 private:
  backend::device& device_;
  std::size_t size_;
  std::uint64_t id_;
  void* base_ = nullptr;
  backend::physical_ref chunk_{};
  backend::shareable_handle handle_;
};

/// `bytes` rounded up to a multiple of `granularity`; 0 when that overflows.
[[nodiscard]] std::size_t round_up(std::size_t bytes, std::size_t granularity) noexcept;

}  // namespace shoal::lending::detail
