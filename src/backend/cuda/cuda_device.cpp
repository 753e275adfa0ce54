// The CUDA device's lifetime: construction, teardown, and finding devices.
#include "backend/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <optional>

#include "backend/cuda/cuda_current_device.h"
#include "backend/cuda/cuda_driver.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {

// The name of device `ordinal` (made current meanwhile: its context starts).
std::string device_name(int ordinal) {
  const device_scope on_device(ordinal);
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, ordinal), "cudaGetDeviceProperties");
  return properties.name;
}

cudaError_t device_count(int& count) noexcept {
  count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  return result;
}

std::string unavailable_reason(cudaError_t result, int count) {
  if (result == cudaErrorInsufficientDriver) {
    // The runtime says "insufficient" for a missing driver too; the driver
    // version (0 when none loads) tells the two apart.
    int driver_version = 0;
    if (cudaDriverGetVersion(&driver_version) != cudaSuccess) cudaGetLastError();
    if (driver_version == 0) {
      return "cudaGetDeviceCount failed: " + describe(result) +
             "; no NVIDIA driver is installed here (none loads in this process), so there is no GPU to use: "
             "the host backend (SHOAL_BACKEND=host) runs without one";
    }
    return "cudaGetDeviceCount failed: " + describe(result) + "; the installed driver supports CUDA " +
           std::to_string(driver_version / 1000) + "." + std::to_string(driver_version % 1000 / 10) +
           ": install an NVIDIA driver of the CUDA 13 generation (580 or newer)";
  }
  if (result == cudaErrorNoDevice) {
    return "cudaGetDeviceCount failed: " + describe(result) +
           "; no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)";
  }
  if (result != cudaSuccess) return "cudaGetDeviceCount failed: " + describe(result);
  return count == 0 ? "the CUDA driver reports no devices" : "";
}

}  // namespace

// ---- lifetime ----------------------------------------------------------------

cuda_device::cuda_device(int ordinal)
    : ordinal_(ordinal),
      streams_(ordinal),
      name_(device_name(ordinal)),
      memory_(ordinal),
      sharing_(ordinal) {}

cuda_device::~cuda_device() {
  // Errors are ignored: at process exit the runtime may already be gone.
  // The driver table was loaded by the constructor, so driver() cannot throw.
  std::optional<device_scope> on_device;
  try {
    on_device.emplace(ordinal_);
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): the teardown's calls fail alike, and are ignored
  }
  const cuda_driver& d = driver();
  memory_.teardown_imports(d);
  streams_.teardown();       // streams, then events
  sharing_.teardown();       // exported events, then imported ones
  memory_.teardown_rest(d);  // mappings, chunks, reservations, segments
  cudaGetLastError();
}

// ---- finding devices ------------------------------------------------------------------

int cuda_device_count_impl() noexcept {
  int count = 0;
  device_count(count);
  return count;
}

std::string cuda_unavailable_reason_impl() {
  int count = 0;
  const cudaError_t result = device_count(count);
  return unavailable_reason(result, count);
}

std::unique_ptr<device> make_cuda_device(int ordinal) {
  int count = 0;
  const cudaError_t result = device_count(count);
  if (const std::string reason = unavailable_reason(result, count); !reason.empty()) {
    throw device_unavailable("no CUDA device: " + reason);
  }
  if (ordinal < 0 || ordinal >= count) {
    throw device_unavailable("no CUDA device: ordinal " + std::to_string(ordinal) + " was asked for, but there " +
                             (count == 1 ? "is 1 CUDA device (ordinal 0)"
                                         : "are " + std::to_string(count) + " CUDA devices (ordinals 0 to " +
                                               std::to_string(count - 1) + ")"));
  }
  return std::make_unique<cuda_device>(ordinal);
}

}  // namespace shoal::backend::detail
