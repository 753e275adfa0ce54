// PyTorch's allocator trace trackers for the PyTorch plugin
// (c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker, which
// PyTorch's pluggable allocator refuses): callbacks PyTorch's own code
// attaches to follow the allocator's memory — ProcessGroupNCCL's buffer
// registration (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) registers
// each segment with its NCCL communicators at "segment_alloc" /
// "segment_map" and deregisters it at "segment_free" / "segment_unmap".
//
// Each tracker is told every segment entry (shoal's segment observer:
// memory taken from the device or given back), whether or not memory
// history records, with no context. Over growable segments the plugin
// refuses trackers: PyTorch turns NCCL's hook off under its own expandable
// segments (the hook registers whole segments and ignores segment_map /
// segment_unmap), and cannot see shoal's. Not as PyTorch's allocator tells them:
// the entries of single allocations and frees are not told (no tracker
// inside PyTorch reads them, and they would cost every allocation).
//
// Thread-safety: attach and notify may be called from any thread at once.
// Trackers are called on the thread that took or gave back the memory, under
// shoal's allocator locks (as PyTorch's allocator calls them under its own):
// a tracker must not call PyTorch's CUDA allocator at all (allocate, free,
// snapshot, empty_cache). A graph pool's or MemPool's segment entries name
// its MempoolId (NCCL's register_mem_pool follows a pool's segments by it).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <mutex>
#include <vector>

namespace shoal_torch {

class trace_trackers {
 public:
  using tracker = c10::cuda::CUDACachingAllocator::AllocatorTraceTracker;
  using trace_entry = c10::cuda::CUDACachingAllocator::TraceEntry;

  /// Trackers are kept for the rest of the process, as PyTorch keeps them.
  void attach(tracker t);

  /// True when a tracker is attached (one relaxed load).
  [[nodiscard]] bool any() const noexcept { return count_.load(std::memory_order_relaxed) != 0; }

  /// Tells every tracker `entry`. One that throws is reported on stderr and
  /// the others are told.
  void notify(const trace_entry& entry) const noexcept;

 private:
  mutable std::mutex mutex_;
  std::vector<tracker> trackers_;  // guarded by mutex_
  std::atomic<size_t> count_{0};
};

}  // namespace shoal_torch
