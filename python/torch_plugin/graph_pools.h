// CUDA graph pools for the PyTorch plugin: what PyTorch's pool hooks
// (beginAllocateToPool, endAllocateToPool, releasePool, createOrIncrefPool,
// getPoolUseCount, checkPoolLiveAllocations) ask of an allocator, on
// shoal's growing private pools.
//
// A capture (torch.cuda.graph) or torch.cuda.use_mem_pool routes the
// allocations its filter accepts (the capturing stream, or the calling
// thread) to the pool of its MempoolId; the pool's memory stays its own
// until the last user releases it, and goes back to the device once no
// block of it is allocated any more (at that release, or at a later
// empty_cache or out of memory).
//
// While a route is active, every allocation and free runs in relaxed capture
// mode (a capture in global mode would otherwise be invalidated by the
// allocator's event queries and cudaMalloc), no allocation waits on the host
// or gives memory back (that synchronizes streams: a miss growth cannot
// serve is out of memory, as in PyTorch's allocator during a capture), no
// released pool is destroyed, and a free that would record an event (a block
// freed on a stream other than its own, or one record_stream named) is
// deferred until no route is left: an event recorded on a capturing stream
// could not be queried. Before each route begins (PyTorch begins it before
// the capture), its pool waits for the streams that last used its free
// blocks and forgets them: a wait inside the capture on a stream outside it
// is refused by CUDA, and a pool's graphs replay in capture order anyway.
//
// Thread-safety: every member may be called from any thread at once.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torch_api.h"

namespace shoal_torch {

using mempool_id = c10::cuda::MempoolId_t;

class graph_pools {
 public:
  explicit graph_pools(const shoal_torch_api& api) : api_(api) {}

  /// True while some allocations are routed to a pool: one load.
  [[nodiscard]] bool routing() const noexcept { return routes_count_.load(std::memory_order_acquire) > 0; }
  /// An allocation while routing: from the pool of the route that accepts
  /// `stream` on `device`, else from the ordinary pools. `pool` (may be
  /// null) receives that route's MempoolId (left as it is when none accepts),
  /// also when the allocation fails. Throws PyTorch's errors.
  void* allocate(size_t bytes, int device, cudaStream_t stream, mempool_id* pool);
  /// A free while routing (see the file comment). Returns the table's
  /// status; throws PyTorch's error when the capture mode cannot be switched.
  int deallocate(void* ptr, int device, cudaStream_t stream);

  void create_or_incref(c10::DeviceIndex device, mempool_id id);
  void begin(c10::DeviceIndex device, mempool_id id, std::function<bool(cudaStream_t)> filter);
  void end(c10::DeviceIndex device, mempool_id id);
  void release(c10::DeviceIndex device, mempool_id id);
  [[nodiscard]] int use_count(c10::DeviceIndex device, mempool_id id);
  /// True when the tensors PyTorch holds in the pool start exactly at
  /// `expected` (frees deferred past a capture count as done).
  [[nodiscard]] bool live_blocks_are(c10::DeviceIndex device, mempool_id id,
                                     const std::unordered_set<void*>& expected);
  /// Destroys the released pools none of whose blocks is allocated any
  /// more; true when one was.
  bool destroy_released();
  /// The MempoolId of each of shoal's pools, by (device, shoal's handle):
  /// pools in use, and released pools whose memory is not back yet.
  [[nodiscard]] std::map<std::pair<int, std::uint64_t>, mempool_id> ids() const;
  /// The MempoolId of shoal's pool `handle` on `device` ({0, 0}: none of
  /// these pools). Takes only a lock nothing else is called under: safe in
  /// a segment observer, under shoal's locks, while a member of this class
  /// calls shoal.
  [[nodiscard]] mempool_id id_of(int device, std::uint64_t handle) const noexcept;

  /// A checkpoint of the pool's layout (getCheckpointState), for CUDA graph
  /// trees. Throws PyTorch's error for a pool that does not exist.
  [[nodiscard]] std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> checkpoint(c10::DeviceIndex device,
                                                                                          mempool_id id);
  /// Lays the checkpoint's pool out again (setCheckpointPoolState):
  /// `prepare` is told first how many blocks the pool has allocated now and
  /// how many the checkpoint allocates again (to make room, so that the
  /// callbacks need no memory once the layout changed); then each block the
  /// restore freed goes to `freed`, each it allocated again to `allocated`
  /// (address, size, the stream it was handed out on, the pool's
  /// MempoolId). Throws PyTorch's error for a state that is no checkpoint
  /// of shoal's, of a pool released since, while
  /// allocations are routed to this pool, while a free of one of its blocks
  /// is deferred (the restore would free that block, and the routes' end
  /// again), or that the pool refuses (restore_private_pool), and the first
  /// error of a callback, after the others were told; a block allocated
  /// again whose callback threw is freed (it has no owner). Routes to other
  /// pools do not stop it: it runs in relaxed capture mode. No allocation
  /// from or free to the pool may race it (its checks come first; CUDA
  /// graph trees restore on the thread that uses the pool).
  void restore(c10::DeviceIndex device, const c10::cuda::CUDACachingAllocator::AllocatorState& state,
               const std::function<void(size_t freed, size_t allocated)>& prepare,
               const std::function<void(void*)>& freed,
               const std::function<void(void*, size_t, cudaStream_t, mempool_id)>& allocated);

 private:
  using key = std::pair<c10::DeviceIndex, mempool_id>;
  struct pool {
    std::uint64_t handle = 0;  ///< shoal's
    int uses = 0;
  };
  struct route {
    key of;
    std::function<bool(cudaStream_t)> filter;
    std::uint64_t handle;
  };
  struct deferred_free {
    void* ptr;
    int device;
    cudaStream_t stream;
    std::uint64_t flush;  ///< 0 while waiting; then the ticket of the end that carries it out (listed until freed)
  };
  pool& pool_of(const key& k);  // made on first use; mutex_ held
  /// The blocks of shoal's pool `handle` allocated now (room for `expected`
  /// first); mutex_ not held.
  std::vector<void*> allocated_blocks(std::uint64_t handle, int device, size_t expected);

  const shoal_torch_api& api_;
  std::mutex mutex_;
  std::map<key, pool> pools_;                                 // guarded by mutex_
  std::vector<route> routes_;                                 // guarded by mutex_
  std::vector<deferred_free> deferred_;                       // guarded by mutex_
  std::uint64_t flushes_ = 0;                                 // the last flush's ticket; guarded by mutex_
  struct released_pool {
    int device;
    std::uint64_t handle;
    bool failed;  ///< its destroy failed once (said on stderr then, not at every retry)
  };
  std::vector<released_pool> released_;                       // guarded by mutex_
  /// The MempoolId of every shoal pool made here until it is destroyed (a
  /// released one's too). Named before its first allocation, forgotten after
  /// its destroy: every segment event of a pool finds its name.
  mutable std::mutex ids_mutex_;  // a leaf: taken under mutex_ and shoal's locks, nothing called under it
  std::map<std::pair<int, std::uint64_t>, mempool_id> ids_;  // guarded by ids_mutex_
  std::atomic<int> routes_count_{0};                          // routes_.size()
};

}  // namespace shoal_torch
