#include "backend/cuda/cuda_current_device.h"

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "backend/cuda/cuda_driver.h"

namespace shoal::backend::detail {

namespace {

constexpr int cached_devices = 64;

// Each device's primary context, learned at its first switch: later
// switches are one driver store each way (a thread with no context, such
// as a program's own threads, switches on every call).
std::array<std::atomic<CUcontext>, cached_devices> primary_contexts{};

}  // namespace

device_scope::device_scope(int ordinal) {
  const cuda_driver& d = driver();
  CUcontext current = nullptr;
  check(d.ctx_get_current(&current), "cuCtxGetCurrent");
  const bool cached = ordinal >= 0 && ordinal < cached_devices;
  CUcontext primary = cached ? primary_contexts[ordinal].load(std::memory_order_acquire) : nullptr;
  if (primary != nullptr && current == primary) return;
  if (primary != nullptr) {
    check(d.ctx_set_current(primary), "cuCtxSetCurrent");
  } else {
    check(cudaSetDevice(ordinal), "cudaSetDevice");  // starts the primary context on first use
    check(d.ctx_get_current(&primary), "cuCtxGetCurrent");
    if (cached) primary_contexts[ordinal].store(primary, std::memory_order_release);
  }
  previous_ = current;
  switched_ = true;
}

device_scope::~device_scope() {
  // A failure leaves this device current; a destructor has no one to tell.
  if (switched_) (void)driver().ctx_set_current(previous_);
}

std::string cuda_label(int ordinal) { return "cuda device " + std::to_string(ordinal); }

}  // namespace shoal::backend::detail
