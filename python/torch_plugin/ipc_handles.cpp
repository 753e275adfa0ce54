#include "ipc_handles.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "plugin_status.h"

namespace shoal_torch {

namespace {

constexpr char cuda_malloc_type = 'c';
constexpr char expandable_segment_type = 'e';
// Written with 'c' handles: PyTorch up to 2.12 writes 2 and refuses newer
// versions; 2.13 writes 3 with the same 'c' payload, and reads 2.
constexpr char written_version = 2;
constexpr char newest_read_version = 3;

// Allocations opened here, by their handle's bytes: each is opened once
// while any tensor of it lives (CUDA opens a handle once per context).
std::mutex opened_mutex;
std::unordered_map<std::string, std::weak_ptr<void>> opened;  // guarded by opened_mutex

std::shared_ptr<void> open_cuda_malloc(const std::string& handle, const cudaIpcMemHandle_t& ipc_handle) {
  std::lock_guard lock(opened_mutex);
  if (const auto found = opened.find(handle); found != opened.end()) {
    if (std::shared_ptr<void> mapped = found->second.lock()) return mapped;
  }
  void* mapped = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, ipc_handle, cudaIpcMemLazyEnablePeerAccess));
  const c10::DeviceIndex device = c10::cuda::current_device();
  std::shared_ptr<void> held(mapped, [handle, device](void* ptr) {
    const c10::cuda::CUDAGuard on_device(device);
    std::lock_guard lock(opened_mutex);
    // A later open of the same handle waits for this close (the lock).
    if (const auto found = opened.find(handle); found != opened.end() && found->second.expired()) opened.erase(found);
    (void)cudaIpcCloseMemHandle(ptr);  // at exit the runtime may be gone: nothing to do then
    (void)cudaGetLastError();
  });
  opened[handle] = held;
  return held;
}

}  // namespace

c10::cuda::CUDACachingAllocator::ShareableHandle share_ipc_handle(const shoal_torch_api& api, void* ptr, int device) {
  void* base = nullptr;
  size_t size = 0;
  check(api, api.block_segment(ptr, device, &base, &size), "sharing a CUDA tensor with another process");
  cudaIpcMemHandle_t ipc_handle{};
  {
    const c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaIpcGetMemHandle(&ipc_handle, base));
  }
  std::string handle{written_version, cuda_malloc_type};
  handle.append(reinterpret_cast<const char*>(&ipc_handle), sizeof ipc_handle);
  return {static_cast<std::ptrdiff_t>(static_cast<char*>(ptr) - static_cast<char*>(base)), handle};
}

std::shared_ptr<void> open_ipc_handle(const std::string& handle,
                                      c10::cuda::CUDACachingAllocator::CUDAAllocator* previous) {
  cudaIpcMemHandle_t ipc_handle{};
  if (handle.size() == sizeof ipc_handle) {  // an older PyTorch's bare cudaMalloc handle
    std::memcpy(&ipc_handle, handle.data(), sizeof ipc_handle);
    return open_cuda_malloc(handle, ipc_handle);
  }
  TORCH_CHECK(handle.size() >= 2, "shoal: a CUDA IPC handle of ", handle.size(),
              " bytes is not one PyTorch writes (a version and a type first)");
  const char type = handle[1];
  if (type == expandable_segment_type) {
    // The sender's PyTorch allocator used expandable segments: the format
    // is its own, and so is the code that maps it. It needs its per-device
    // state, which it never made here (shoal took its place first).
    TORCH_CHECK(previous != nullptr, "shoal: a tensor from an expandable segment of another process's PyTorch "
                                     "allocator cannot be opened here (PyTorch's own allocator is not available)");
    static std::once_flag made;
    std::call_once(made, [previous] {
      if (!previous->initialized()) previous->init(c10::cuda::device_count());
    });
    return previous->getIpcDevPtr(handle);
  }
  TORCH_CHECK(type == cuda_malloc_type, "shoal: a CUDA IPC handle of type '", type,
              "' is not one this PyTorch's sharing writes ('c' or 'e')");
  TORCH_CHECK(handle[0] <= newest_read_version, "shoal: a CUDA IPC handle of version ", static_cast<int>(handle[0]),
              " comes from a newer PyTorch than any whose format shoal knows (", static_cast<int>(newest_read_version),
              ")");
  TORCH_CHECK(handle.size() == 2 + sizeof ipc_handle, "shoal: a CUDA IPC handle of type 'c' has ",
              sizeof ipc_handle, " bytes after its version and type, not ", handle.size() - 2);
  std::memcpy(&ipc_handle, handle.data() + 2, sizeof ipc_handle);
  return open_cuda_malloc(handle, ipc_handle);
}

}  // namespace shoal_torch
