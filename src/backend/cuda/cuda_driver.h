// CUDA driver entry points reached through the runtime, and the conversion of
// CUDA error codes into shoal's typed errors.
//
// libcuda is never linked: the static runtime opens it at run time and
// cudaGetDriverEntryPointByVersion hands out the driver functions, so the
// library loads where there is no driver and reports "no CUDA device" then.
//
// Thread-safety: driver() may be called from any thread; the table is filled
// once and read-only afterwards. check() and describe() are thread-safe.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace shoal::backend::detail {

/// The driver functions the CUDA backend uses (virtual memory management,
/// device attributes, error text and the calling thread's context). Every pointer is non-null once driver() has returned.
struct cuda_driver {
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemRetainAllocationHandle_v11000 mem_retain_allocation_handle = nullptr;
  PFN_cuMemGetAddressRange_v3020 mem_get_address_range = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
  PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 primary_ctx_retain = nullptr;
};

/// The process-wide table, fetched on first use. Throws
/// shoal::device_unavailable, naming the function, when the driver lacks one
/// (no driver, or one older than CUDA 12.0); a later call tries again.
[[nodiscard]] const cuda_driver& driver();

/// "<error string> (<error name>)" for a runtime or driver result.
[[nodiscard]] std::string describe(cudaError_t result);
[[nodiscard]] std::string describe(CUresult result);

/// Whether `result` is the failure of device work enqueued earlier (a kernel
/// fault, a device-side assert): CUDA keeps it, and every later call in the
/// process fails with it, waiting or not.
[[nodiscard]] bool is_work_failure(cudaError_t result) noexcept;
[[nodiscard]] bool is_work_failure(CUresult result) noexcept;

/// Throws shoal::stream_error for a work failure that `call` returned,
/// saying that the process must restart; `where` names the device ("" when
/// unknown).
[[noreturn]] void throw_work_failure(const char* call, const std::string& description, const std::string& where);

/// Does nothing on success. Otherwise clears the runtime's non-sticky error
/// and throws: shoal::out_of_memory for cudaErrorMemoryAllocation (saying
/// `requested_bytes` and the current device's free/total memory),
/// shoal::stream_error for a work failure (is_work_failure: a call that only
/// enqueues reports it as a synchronize does), else shoal::backend_error
/// naming `call` — device_unavailable, saying why, in a fork() child of the
/// process that loaded the driver (CUDA fails there).
void check(cudaError_t result, const char* call, std::size_t requested_bytes = 0);
/// As above for driver results; CUDA_ERROR_OUT_OF_MEMORY gives out_of_memory.
void check(CUresult result, const char* call, std::size_t requested_bytes = 0);

}  // namespace shoal::backend::detail
