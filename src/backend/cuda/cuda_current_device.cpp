#include "backend/cuda/cuda_current_device.h"

#include <array>
#include <atomic>
#include <mutex>

#include "backend/cuda/cuda_driver.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {

constexpr int most_devices = 64;

// Each device's primary context, retained at its first switch for the
// process's life (the devices live as long). Switching is then one driver
// store each way: a thread with no context switches on every call of a
// device other than 0. The driver alone: cudaSetDevice would also record
// the device as the thread's choice in the runtime, which putting the
// previous context back does not undo.
std::mutex retaining;
std::array<std::atomic<CUcontext>, most_devices> primary_contexts{};  // each stored once, under `retaining`

CUcontext primary_context(const cuda_driver& d, int ordinal) {
  if (ordinal < 0 || ordinal >= most_devices) {
    throw invalid_argument("cuda device " + std::to_string(ordinal) + ": shoal serves the first " +
                           std::to_string(most_devices) + " CUDA devices");
  }
  if (CUcontext known = primary_contexts[ordinal].load(std::memory_order_acquire)) return known;
  std::lock_guard lock(retaining);
  CUcontext context = primary_contexts[ordinal].load(std::memory_order_relaxed);
  if (context == nullptr) {
    CUdevice device = 0;
    check(d.device_get(&device, ordinal), "cuDeviceGet");
    check(d.primary_ctx_retain(&context, device), "cuDevicePrimaryCtxRetain");
    primary_contexts[ordinal].store(context, std::memory_order_release);
  }
  return context;
}

}  // namespace

device_scope::device_scope(int ordinal) {
  const cuda_driver& d = driver();
  CUcontext current = nullptr;
  check(d.ctx_get_current(&current), "cuCtxGetCurrent");
  const CUcontext primary = primary_context(d, ordinal);
  if (current == primary) return;
  check(d.ctx_set_current(primary), "cuCtxSetCurrent");
  // A thread with no context keeps device 0's primary context: the one the
  // CUDA runtime makes current at such a thread's first call, so its runtime
  // device stays 0 — and its later calls here switch nothing. Any other
  // device's would move the thread's runtime device (or start a context on
  // device 0 when put back), so it goes back to none.
  if (current == nullptr && ordinal == 0) return;
  previous_ = current;
  switched_ = true;
}

device_scope::~device_scope() {
  // A failure leaves this device current; a destructor has no one to tell.
  if (switched_) (void)driver().ctx_set_current(previous_);
}

std::string cuda_label(int ordinal) { return "cuda device " + std::to_string(ordinal); }

}  // namespace shoal::backend::detail
