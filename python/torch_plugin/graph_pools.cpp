#include "graph_pools.h"

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <utility>

#include "plugin_status.h"

namespace shoal_torch {

namespace {

// Every call into shoal while a route is active: cudaMalloc and event
// queries are refused (and invalidate the capture) in global mode.
using relaxed_capture_mode = c10::cuda::CUDAStreamCaptureModeGuard;
constexpr cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;

}  // namespace

graph_pools::pool& graph_pools::pool_of(const key& k) {
  auto it = pools_.find(k);
  if (it == pools_.end()) {
    pool made;
    check(api_, api_.create_graph_pool(k.first, &made.handle), "graph pool");
    const std::pair<int, std::uint64_t> named{k.first, made.handle};
    try {
      {
        std::lock_guard ids(ids_mutex_);
        ids_.emplace(named, k.second);
      }
      it = pools_.emplace(k, made).first;
    } catch (...) {  // out of host memory: the new pool, empty, goes back
      {
        std::lock_guard ids(ids_mutex_);
        ids_.erase(named);
      }
      int destroyed = 0;
      (void)api_.destroy_graph_pool(made.handle, k.first, &destroyed);
      throw;
    }
  }
  return it->second;
}

void* graph_pools::allocate(size_t bytes, int device, cudaStream_t stream, mempool_id* pool) {
  std::uint64_t handle = 0;
  {
    std::lock_guard lock(mutex_);
    for (const route& r : routes_) {
      if (r.of.first == device && r.filter(stream)) {
        handle = r.handle;
        if (pool != nullptr) *pool = r.of.second;
        break;
      }
    }
  }
  relaxed_capture_mode mode{relaxed};
  void* ptr = nullptr;
  // No retry after destroying released pools: that waits for streams,
  // which no call makes while routing (destroy_released refuses then).
  check(api_, api_.allocate_in_pool(handle, bytes, device, stream, &ptr), "allocate");
  return ptr;
}

int graph_pools::deallocate(void* ptr, int device, cudaStream_t stream) {
  {
    relaxed_capture_mode mode{relaxed};
    int freed = 0;
    const int status = api_.deallocate_without_events(ptr, device, stream, &freed);
    if (status != SHOAL_TORCH_OK || freed != 0) return status;
    std::lock_guard lock(mutex_);
    if (!routes_.empty()) {
      deferred_.push_back({ptr, device, stream, 0});
      return SHOAL_TORCH_OK;
    }
  }
  return api_.deallocate(ptr, device, stream);  // the last route ended meanwhile
}

void graph_pools::create_or_incref(c10::DeviceIndex device, mempool_id id) {
  std::lock_guard lock(mutex_);
  ++pool_of({device, id}).uses;
}

void graph_pools::begin(c10::DeviceIndex device, mempool_id id, std::function<bool(cudaStream_t)> filter) {
  const key k{device, id};
  std::uint64_t handle = 0;
  {
    std::lock_guard lock(mutex_);
    for (const route& r : routes_) {
      TORCH_CHECK(r.of != k, "shoal: allocations already go to this memory pool (", id.first, ", ", id.second, ")");
    }
    pool& p = pool_of(k);
    ++p.uses;
    handle = p.handle;
  }
  // PyTorch calls this before the capture begins: the pool's free blocks
  // forget the streams of earlier captures and uses now, while waiting for
  // them is still allowed (a wait on one inside the capture is refused).
  try {
    relaxed_capture_mode mode{relaxed};
    check(api_, api_.settle_graph_pool(handle, device), "memory pool");
  } catch (...) {
    std::lock_guard lock(mutex_);
    --pools_.at(k).uses;
    throw;
  }
  std::lock_guard lock(mutex_);
  routes_.push_back({k, std::move(filter), handle});
  routes_count_.store(static_cast<int>(routes_.size()), std::memory_order_release);
}

void graph_pools::end(c10::DeviceIndex device, mempool_id id) {
  const key k{device, id};
  std::vector<deferred_free> flush;
  std::uint64_t ticket = 0;
  {
    std::lock_guard lock(mutex_);
    const auto it = std::find_if(routes_.begin(), routes_.end(), [&](const route& r) { return r.of == k; });
    TORCH_CHECK(it != routes_.end(), "shoal: no allocations go to memory pool (", id.first, ", ", id.second, ")");
    if (routes_.size() == 1) {  // no capture left after this: the deferred frees' events may be recorded now
      flush.reserve(deferred_.size());  // before anything changes
      ticket = ++flushes_;
      for (deferred_free& f : deferred_) {
        if (f.flush != 0) continue;  // another end carries it out
        f.flush = ticket;
        flush.push_back(f);
      }
    }
    routes_.erase(it);
    routes_count_.store(static_cast<int>(routes_.size()), std::memory_order_release);
  }
  if (flush.empty()) return;
  for (const deferred_free& f : flush) {
    if (api_.deallocate(f.ptr, f.device, f.stream) != SHOAL_TORCH_OK) {
      std::fprintf(stderr, "shoal: freeing a PyTorch block after a capture failed: %s\n", api_.last_error());
    }
  }
  {
    // Listed until freed: a restore meanwhile sees them waiting.
    std::lock_guard lock(mutex_);
    std::erase_if(deferred_, [&](const deferred_free& f) { return f.flush == ticket; });
  }
  (void)destroy_released();  // those frees may have been a released pool's last blocks
}

void graph_pools::release(c10::DeviceIndex device, mempool_id id) {
  {
    std::lock_guard lock(mutex_);
    const auto it = pools_.find({device, id});
    TORCH_CHECK(it != pools_.end(), "shoal: memory pool (", id.first, ", ", id.second, ") does not exist");
    if (--it->second.uses > 0) return;
    released_.push_back({device, it->second.handle, false});
    pools_.erase(it);
  }
  (void)destroy_released();
}

namespace {

// A checkpoint of shoal's, held by PyTorch between getCheckpointState and
// setCheckpointPoolState (and longer: CUDA graph trees keep one per graph).
struct pool_checkpoint final : c10::cuda::CUDACachingAllocator::AllocatorState {
  pool_checkpoint(const shoal_torch_api& api, c10::DeviceIndex device, mempool_id id, void* taken,
                  size_t allocated_blocks)
      : api(api), device(device), id(id), taken(taken), allocated_blocks(allocated_blocks) {}
  ~pool_checkpoint() override { (void)api.free_graph_pool_checkpoint(taken); }
  pool_checkpoint(const pool_checkpoint&) = delete;
  pool_checkpoint& operator=(const pool_checkpoint&) = delete;

  const shoal_torch_api& api;
  c10::DeviceIndex device;
  mempool_id id;
  void* taken;  ///< the table's checkpoint
  size_t allocated_blocks;  ///< what a restore allocates again
};

struct restore_visit {
  const shoal_torch_api& api;
  int device;
  mempool_id id;
  const std::function<void(void*)>& freed;
  const std::function<void(void*, size_t, cudaStream_t, mempool_id)>& allocated;
  std::exception_ptr failed;  ///< the first error of a callback: the visitor must not throw

  static void visit(void* context, int action, uintptr_t address, size_t size, void* stream) noexcept {
    auto* self = static_cast<restore_visit*>(context);
    void* const ptr = reinterpret_cast<void*>(address);
    try {
      if (action == SHOAL_TORCH_RESTORE_FREED) {
        self->freed(ptr);
      } else {
        self->allocated(ptr, size, static_cast<cudaStream_t>(stream), self->id);
      }
    } catch (...) {
      if (!self->failed) self->failed = std::current_exception();
      // A block allocated again that nobody took would be lost: it goes back.
      if (action != SHOAL_TORCH_RESTORE_FREED) (void)self->api.deallocate(ptr, self->device, stream);
    }
  }
};

}  // namespace

std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> graph_pools::checkpoint(c10::DeviceIndex device,
                                                                                         mempool_id id) {
  std::uint64_t handle = 0;
  {
    std::lock_guard lock(mutex_);
    const auto it = pools_.find({device, id});
    TORCH_CHECK(it != pools_.end(), "shoal: memory pool (", id.first, ", ", id.second, ") does not exist");
    handle = it->second.handle;
  }
  void* taken = nullptr;
  size_t allocated = 0;
  check(api_, api_.checkpoint_graph_pool(handle, device, &taken, &allocated), "checkpoint of a memory pool");
  std::unique_ptr<void, int (*)(void*)> held(taken, api_.free_graph_pool_checkpoint);  // until the state owns it
  auto state = std::make_shared<pool_checkpoint>(api_, device, id, taken, allocated);
  (void)held.release();
  return state;
}

void graph_pools::restore(c10::DeviceIndex device, const c10::cuda::CUDACachingAllocator::AllocatorState& state,
                          const std::function<void(size_t, size_t)>& prepare, const std::function<void(void*)>& freed,
                          const std::function<void(void*, size_t, cudaStream_t, mempool_id)>& allocated) {
  const auto* saved = dynamic_cast<const pool_checkpoint*>(&state);
  TORCH_CHECK(saved != nullptr, "shoal: this allocator state is no checkpoint of shoal's memory pools");
  TORCH_CHECK(saved->device == device, "shoal: a checkpoint of device ", saved->device, " given for device ", device);
  const key k{device, saved->id};
  std::uint64_t handle = 0;
  std::unordered_set<void*> waiting;  // this device's frees deferred until no route is left
  {
    std::lock_guard lock(mutex_);
    const auto it = pools_.find(k);
    TORCH_CHECK(it != pools_.end(), "shoal: the checkpoint's memory pool (", saved->id.first, ", ", saved->id.second,
                ") was released");
    // Its allocations would land in the layout being rebuilt.
    TORCH_CHECK(std::none_of(routes_.begin(), routes_.end(), [&](const route& r) { return r.of == k; }),
                "shoal: a memory pool's checkpoint cannot be restored while allocations are routed to that pool "
                "(inside its torch.cuda.use_mem_pool or a CUDA graph capture into it): restore it after that block");
    for (const deferred_free& f : deferred_) {
      if (f.device == device) waiting.insert(f.ptr);
    }
    handle = it->second.handle;
  }
  // Another thread's capture in global mode would refuse the restore's event
  // calls, and be invalidated by them.
  relaxed_capture_mode mode{relaxed};
  const std::vector<void*> live = allocated_blocks(handle, device, saved->allocated_blocks);
  // The restore would free such a block, and the routes' end again.
  TORCH_CHECK(std::none_of(live.begin(), live.end(), [&](void* p) { return waiting.count(p) != 0; }),
              "shoal: a memory pool's checkpoint cannot be restored while a free of one of its blocks waits for the "
              "allocations routed to memory pools to end (a block another stream used, freed inside "
              "torch.cuda.use_mem_pool or a CUDA graph capture): restore it after those blocks");
  prepare(live.size(), saved->allocated_blocks);  // room for what the restore tells: its callbacks then allocate nothing
  std::vector<void*> freed_here;
  freed_here.reserve(live.size());
  const std::function<void(void*)> note_freed = [&](void* p) {
    freed_here.push_back(p);  // within the room reserved above
    freed(p);
  };
  restore_visit visit{api_, device, saved->id, note_freed, allocated, nullptr};
  check(api_, api_.restore_graph_pool(handle, device, saved->taken, &visit, &restore_visit::visit),
        "restore of a memory pool");
  {
    // A free of such a block deferred after the check above (a free racing
    // the restore, which the header forbids) must not free it again.
    std::lock_guard lock(mutex_);
    std::erase_if(deferred_, [&](const deferred_free& f) {
      return f.flush == 0 && f.device == device && std::find(freed_here.begin(), freed_here.end(), f.ptr) != freed_here.end();
    });
  }
  if (visit.failed) std::rethrow_exception(visit.failed);
}

int graph_pools::use_count(c10::DeviceIndex device, mempool_id id) {
  std::lock_guard lock(mutex_);
  const auto it = pools_.find({device, id});
  return it == pools_.end() ? 0 : it->second.uses;
}

bool graph_pools::live_blocks_are(c10::DeviceIndex device, mempool_id id,
                                  const std::unordered_set<void*>& expected) {
  std::uint64_t handle = 0;
  std::unordered_set<void*> deferred;
  {
    std::lock_guard lock(mutex_);
    const auto it = pools_.find({device, id});
    if (it == pools_.end()) return expected.empty();
    handle = it->second.handle;
    for (const deferred_free& f : deferred_) deferred.insert(f.ptr);
  }
  size_t live = 0;
  for (void* block : allocated_blocks(handle, device, expected.size() + deferred.size())) {
    if (deferred.count(block) != 0) continue;
    if (expected.count(block) == 0) return false;
    ++live;
  }
  return live == expected.size();
}

std::vector<void*> graph_pools::allocated_blocks(std::uint64_t handle, int device, size_t expected) {
  std::vector<void*> blocks(expected + 16);
  size_t count = 0;
  for (;;) {
    check(api_, api_.graph_pool_allocated_blocks(handle, device, blocks.data(), blocks.size(), &count), "pool blocks");
    if (count <= blocks.size()) break;
    blocks.resize(count);
  }
  blocks.resize(count);
  return blocks;
}

bool graph_pools::destroy_released() {
  // Not while a capture may be underway: a destroy waits for streams.
  if (routing()) return false;
  std::vector<released_pool> candidates;
  {
    std::lock_guard lock(mutex_);
    candidates.swap(released_);
  }
  if (candidates.empty()) return false;
  std::vector<released_pool> kept;
  std::vector<std::pair<int, std::uint64_t>> gone;
  {
    relaxed_capture_mode mode{relaxed};
    for (released_pool& pool : candidates) {
      int destroyed = 0;
      if (api_.destroy_graph_pool(pool.handle, pool.device, &destroyed) != SHOAL_TORCH_OK) {
        if (!std::exchange(pool.failed, true)) {
          std::fprintf(stderr, "shoal: giving a released memory pool back failed (tried again later, silently): %s\n",
                       api_.last_error());
        }
        kept.push_back(pool);
      } else if (destroyed != 0) {
        gone.emplace_back(pool.device, pool.handle);
      } else {
        kept.push_back(pool);  // a block of it is still allocated: later
      }
    }
  }
  {
    std::lock_guard ids(ids_mutex_);
    for (const auto& pool : gone) ids_.erase(pool);
  }
  std::lock_guard lock(mutex_);
  released_.insert(released_.end(), kept.begin(), kept.end());
  return !gone.empty();
}

std::map<std::pair<int, std::uint64_t>, mempool_id> graph_pools::ids() const {
  std::lock_guard ids(ids_mutex_);
  return ids_;
}

mempool_id graph_pools::id_of(int device, std::uint64_t handle) const noexcept {
  std::lock_guard ids(ids_mutex_);
  const auto found = ids_.find({device, handle});
  return found == ids_.end() ? mempool_id{0, 0} : found->second;
}

}  // namespace shoal_torch
