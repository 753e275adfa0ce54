// CUDA tensors through torch.multiprocessing while shoal is PyTorch's
// allocator: what PyTorch's allocator does for its IPC (shareIpcHandle,
// getIpcDevPtr), in PyTorch's own handle format, so a process with shoal
// and one with PyTorch's allocator exchange tensors either way.
//
// A handle is "<version><type><payload>": type 'c', a cudaMalloc allocation
// (payload: its cudaIpcMemHandle_t, 64 bytes), or 'e', a PyTorch expandable
// segment; a bare 64-byte cudaIpcMemHandle_t is an older PyTorch's 'c'.
//   - Sent: a block of a plain shoal segment goes as 'c' (its whole
//     cudaMalloc allocation, and the block's offset in it), with version 2,
//     which PyTorch up to 2.12 writes and 2.13 still reads for 'c'. A block
//     of a growable segment is refused with a reason: CUDA IPC cannot
//     export one, and shoal's own sharing serves it.
//   - Received: 'c' is opened here (once per allocation while any tensor of
//     it lives, as PyTorch does); 'e' by the allocator PyTorch had before
//     shoal's, which knows its own segments' format.
// What keeps a sent block alive while the receiver uses it is PyTorch's own
// (its ref-count files and limbo), above the allocator.
//
// Thread-safety: both functions may be called from any thread at once.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <memory>
#include <string>

#include "torch_api.h"

namespace shoal_torch {

/// The handle PyTorch's sharing sends for the block at `ptr` of `device`.
/// Throws PyTorch's error (shoal's reason) for a block it cannot share.
[[nodiscard]] c10::cuda::CUDACachingAllocator::ShareableHandle share_ipc_handle(const shoal_torch_api& api,
                                                                                void* ptr, int device);

/// The device memory another process's `handle` names, mapped on the current
/// device until the last pointer to it goes. `previous` (the allocator
/// PyTorch had before shoal's) opens the handles of its own expandable
/// segments. Throws PyTorch's error naming what failed.
[[nodiscard]] std::shared_ptr<void> open_ipc_handle(const std::string& handle,
                                                    c10::cuda::CUDACachingAllocator::CUDAAllocator* previous);

}  // namespace shoal_torch
