#include "cuda_driver.h"

#include <string>

#include "core/fork_epoch.h"
#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {

// The ABI version asked of the driver: the PFN_*_v* typedefs used in
// cuda_driver are the ones current at CUDA 12.0.
constexpr unsigned int driver_abi_version = 12000;

template <class Function>
void load(Function& function, const char* symbol) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t result =
      cudaGetDriverEntryPointByVersion(symbol, &address, driver_abi_version, cudaEnableDefault, &status);
  if (result != cudaSuccess || status != cudaDriverEntryPointSuccess || address == nullptr) {
    std::string why = result != cudaSuccess ? describe(result)
                      : status == cudaDriverEntryPointVersionNotSufficent
                          ? "the driver is older than CUDA 12.0"
                          : "the driver does not provide it";
    cudaGetLastError();
    throw device_unavailable("no CUDA device: cannot get driver function " + std::string(symbol) + ": " + why +
                             "; install an NVIDIA driver that supports CUDA 13");
  }
  function = reinterpret_cast<Function>(address);
}

// Made when the driver table is (before any device works): CUDA does not
// work in a fork() child of a process that initialised it, and any call
// that fails there is told as such (check()).
const shoal::detail::fork_epoch& cuda_opened_at() {
  static const shoal::detail::fork_epoch epoch;
  return epoch;
}

[[noreturn]] void throw_failure(const char* call, const std::string& description) {
  if (cuda_opened_at().forked_since()) {
    throw device_unavailable(std::string(call) + ": " + description +
                             "; CUDA was initialised in the parent process, and a fork() child cannot use it. "
                             "Start child processes with spawn or forkserver");
  }
  throw backend_error(call, description);
}

cuda_driver load_all() {
  (void)cuda_opened_at();
  cuda_driver d;
  load(d.mem_create, "cuMemCreate");
  load(d.mem_release, "cuMemRelease");
  load(d.mem_address_reserve, "cuMemAddressReserve");
  load(d.mem_address_free, "cuMemAddressFree");
  load(d.mem_map, "cuMemMap");
  load(d.mem_unmap, "cuMemUnmap");
  load(d.mem_set_access, "cuMemSetAccess");
  load(d.mem_export_to_shareable_handle, "cuMemExportToShareableHandle");
  load(d.mem_import_from_shareable_handle, "cuMemImportFromShareableHandle");
  load(d.mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
  load(d.mem_retain_allocation_handle, "cuMemRetainAllocationHandle");
  load(d.mem_get_address_range, "cuMemGetAddressRange");
  load(d.device_get, "cuDeviceGet");
  load(d.device_get_attribute, "cuDeviceGetAttribute");
  load(d.get_error_string, "cuGetErrorString");
  load(d.get_error_name, "cuGetErrorName");
  load(d.ctx_get_current, "cuCtxGetCurrent");
  load(d.ctx_set_current, "cuCtxSetCurrent");
  load(d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
  return d;
}

[[noreturn]] void throw_out_of_memory(const std::string& what, const char* call, std::size_t requested_bytes) {
  std::string message = std::string(call) + ": " + what;
  if (requested_bytes != 0) message += ": requested " + std::to_string(requested_bytes) + " bytes";
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    message += "; the device has " + std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
               " bytes free";
  } else {
    cudaGetLastError();
  }
  throw out_of_memory(message + "; free cached or unused memory, or ask for less", requested_bytes);
}

}  // namespace

const cuda_driver& driver() {
  static const cuda_driver table = load_all();
  return table;
}

std::string describe(cudaError_t result) {
  return std::string(cudaGetErrorString(result)) + " (" + cudaGetErrorName(result) + ")";
}

std::string describe(CUresult result) {
  const char* text = nullptr;
  const char* name = nullptr;
  const cuda_driver& d = driver();
  if (d.get_error_string(result, &text) != CUDA_SUCCESS || text == nullptr) text = "unknown driver error";
  if (d.get_error_name(result, &name) != CUDA_SUCCESS || name == nullptr) {
    return std::string(text) + " (CUresult " + std::to_string(static_cast<int>(result)) + ")";
  }
  return std::string(text) + " (" + name + ")";
}

bool is_work_failure(cudaError_t result) noexcept {
  switch (result) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorECCUncorrectable:
    case cudaErrorContained:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

// The driver's codes for these failures are the runtime's numbers.
static_assert(static_cast<int>(CUDA_ERROR_ILLEGAL_ADDRESS) == cudaErrorIllegalAddress);
static_assert(static_cast<int>(CUDA_ERROR_LAUNCH_TIMEOUT) == cudaErrorLaunchTimeout);
static_assert(static_cast<int>(CUDA_ERROR_ASSERT) == cudaErrorAssert);
static_assert(static_cast<int>(CUDA_ERROR_HARDWARE_STACK_ERROR) == cudaErrorHardwareStackError);
static_assert(static_cast<int>(CUDA_ERROR_ILLEGAL_INSTRUCTION) == cudaErrorIllegalInstruction);
static_assert(static_cast<int>(CUDA_ERROR_MISALIGNED_ADDRESS) == cudaErrorMisalignedAddress);
static_assert(static_cast<int>(CUDA_ERROR_INVALID_ADDRESS_SPACE) == cudaErrorInvalidAddressSpace);
static_assert(static_cast<int>(CUDA_ERROR_INVALID_PC) == cudaErrorInvalidPc);
static_assert(static_cast<int>(CUDA_ERROR_LAUNCH_FAILED) == cudaErrorLaunchFailure);
static_assert(static_cast<int>(CUDA_ERROR_TENSOR_MEMORY_LEAK) == cudaErrorTensorMemoryLeak);
static_assert(static_cast<int>(CUDA_ERROR_ECC_UNCORRECTABLE) == cudaErrorECCUncorrectable);
static_assert(static_cast<int>(CUDA_ERROR_CONTAINED) == cudaErrorContained);
static_assert(static_cast<int>(CUDA_ERROR_EXTERNAL_DEVICE) == cudaErrorExternalDevice);

bool is_work_failure(CUresult result) noexcept { return is_work_failure(static_cast<cudaError_t>(result)); }

void throw_work_failure(const char* call, const std::string& description, const std::string& where) {
  throw stream_error(std::string(call) + ": work enqueued earlier" + (where.empty() ? "" : " on " + where) +
                     " failed: " + description + "; CUDA keeps this error, so the process must restart to use the GPU");
}

void check(cudaError_t result, const char* call, std::size_t requested_bytes) {
  if (result == cudaSuccess) return;
  cudaGetLastError();
  if (result == cudaErrorMemoryAllocation) throw_out_of_memory(describe(result), call, requested_bytes);
  if (is_work_failure(result) && !cuda_opened_at().forked_since()) throw_work_failure(call, describe(result), "");
  throw_failure(call, describe(result));
}

void check(CUresult result, const char* call, std::size_t requested_bytes) {
  if (result == CUDA_SUCCESS) return;
  if (result == CUDA_ERROR_OUT_OF_MEMORY) throw_out_of_memory(describe(result), call, requested_bytes);
  if (is_work_failure(result) && !cuda_opened_at().forked_since()) throw_work_failure(call, describe(result), "");
  throw_failure(call, describe(result));
}

}  // namespace shoal::backend::detail
