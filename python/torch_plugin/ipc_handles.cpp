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
#include <utility>

#include "plugin_status.h"

namespace shoal_torch {

namespace {

constexpr char cuda_malloc_type = 'c';
constexpr char expandable_segment_type = 'e';
// Written with 'c' handles: PyTorch up to 2.12 writes 2 and refuses newer
// versions; 2.13 writes 3 with the same 'c' payload, and reads 2.
constexpr char written_version = 2;
constexpr unsigned char newest_read_version = 3;

// Allocations opened here, by their handle's bytes: each is opened once
// while any tensor of it lives, as PyTorch's allocator does.
std::mutex opened_mutex;
std::unordered_map<std::string, std::weak_ptr<void>> opened;  // guarded by opened_mutex

// One opened allocation: closed when the last tensor over it goes.
struct ipc_mapping {
  ipc_mapping(std::string handle_bytes, c10::DeviceIndex on) : handle(std::move(handle_bytes)), device(on) {}
  ipc_mapping(const ipc_mapping&) = delete;
  ipc_mapping& operator=(const ipc_mapping&) = delete;
  ~ipc_mapping() {
    if (ptr == nullptr) return;  // never opened
    {
      std::lock_guard lock(opened_mutex);
      // An open of the same handle since then (CUDA counts a handle's opens
      // in a context) keeps its own entry.
      if (const auto found = opened.find(handle); found != opened.end() && found->second.expired()) opened.erase(found);
    }
    // PyTorch's guard puts the thread's device back without making a
    // context there (a thread with none would otherwise get device 0's).
    try {
      const c10::cuda::CUDAGuard on_device(device);
      (void)cudaIpcCloseMemHandle(ptr);  // at exit the runtime may be gone: nothing to do then
      (void)cudaGetLastError();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor has no one to tell
    }
  }

  const std::string handle;
  const c10::DeviceIndex device;
  void* ptr = nullptr;
};

std::shared_ptr<void> open_cuda_malloc(const std::string& handle, const cudaIpcMemHandle_t& ipc_handle) {
  // Made before the lock, and destroyed after it (declared first): its
  // destructor takes the lock, and nothing that can throw runs once it is open.
  auto mapping = std::make_shared<ipc_mapping>(handle, c10::cuda::current_device());
  std::unique_lock lock(opened_mutex);
  std::weak_ptr<void>& entry = opened[handle];
  if (std::shared_ptr<void> mapped = entry.lock()) return mapped;
  const cudaError_t status = cudaIpcOpenMemHandle(&mapping->ptr, ipc_handle, cudaIpcMemLazyEnablePeerAccess);
  if (status != cudaSuccess) {
    mapping->ptr = nullptr;
    opened.erase(handle);
    lock.unlock();
    C10_CUDA_CHECK(status);
  }
  std::shared_ptr<void> held(mapping, mapping->ptr);
  entry = held;
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
  const auto version = static_cast<unsigned char>(handle[0]);
  TORCH_CHECK(version <= newest_read_version, "shoal: a CUDA IPC handle of version ", static_cast<int>(version),
              " comes from a newer PyTorch than any whose format shoal knows (", static_cast<int>(newest_read_version),
              ")");
  TORCH_CHECK(handle.size() == 2 + sizeof ipc_handle, "shoal: a CUDA IPC handle of type 'c' has ",
              sizeof ipc_handle, " bytes after its version and type, not ", handle.size() - 2);
  std::memcpy(&ipc_handle, handle.data() + 2, sizeof ipc_handle);
  return open_cuda_malloc(handle, ipc_handle);
}

}  // namespace shoal_torch
