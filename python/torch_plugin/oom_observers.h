// PyTorch's out-of-memory observers for the PyTorch plugin
// (torch._C._cuda_attach_out_of_memory_observer, attachOutOfMemoryObserver):
// each is told of an allocation refused for want of memory before
// torch.cuda.OutOfMemoryError is raised, as PyTorch's own allocator tells
// them — the device, the bytes asked for, the device's memory (or the share
// of it a memory fraction allows) and its free memory as the driver reports
// it. The usual observer dumps a memory snapshot (torch.cuda.memory._snapshot
// works inside it: no lock of shoal or the plugin is held).
//
// Thread-safety: attach and notify may be called from any thread at once;
// observers are called with no lock held, on the allocating thread.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace shoal_torch {

class oom_observers {
 public:
  using observer = c10::cuda::CUDACachingAllocator::OutOfMemoryObserver;

  /// Observers are kept for the rest of the process, as PyTorch keeps them.
  void attach(observer o);

  /// Tells every observer that `bytes` on `device` were refused, with the
  /// device's memory, or the share of it `memory_fraction` allows (0 or 1:
  /// all of it), and its free memory. One that throws is reported on
  /// stderr: the out-of-memory error goes on.
  void notify(int device, size_t bytes, double memory_fraction) const noexcept;

 private:
  mutable std::mutex mutex_;
  std::vector<observer> observers_;  // guarded by mutex_
};

}  // namespace shoal_torch
