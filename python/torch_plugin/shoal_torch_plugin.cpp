// The PyTorch plugin: built against the installed PyTorch, it makes shoal's
// caching allocators (owned by the _shoal extension, reached through the C
// table of torch_api.h) PyTorch's CUDA allocator.
//
// It is PyTorch's pluggable allocator with what that one lacks:
//   - The free frees on the freeing thread's current stream, not on the
//     allocation stream the pluggable interface passes: a tensor made on a
//     loader's stream and dropped by the model thread is reused only after
//     the model's stream has passed its last use. This is shoal's allocator
//     invariant applied to PyTorch tensors; no record_stream is needed.
//   - Tensor.record_stream, torch.cuda.empty_cache,
//     set_per_process_memory_fraction and torch.cuda.memory_stats reach shoal;
//     cacheInfo (cuDNN's benchmark mode sizes its workspaces with it) and
//     torch.cuda.memory_snapshot (shoal's segments and blocks) too.
//   - torch.multiprocessing sends and receives CUDA tensors (ipc_handles.h).
//   - Out of memory is torch.cuda.OutOfMemoryError with shoal's message,
//     told first to the observers torch._C._cuda_attach_out_of_memory_observer
//     attached (oom_observers.h).
//   - CUDA graph capture (torch.cuda.graph) and torch.cuda.MemPool /
//     use_mem_pool allocate from shoal's growing private pools through
//     PyTorch's pool hooks (graph_pools.h).
//   - torch.cuda.memory._record_memory_history records allocations and
//     frees with their stacks, for torch.cuda.memory._snapshot and the
//     memory viewer (memory_history.h).
// Loaded with ctypes by shoal.torch.enable(); its one entry point is
// shoal_torch_install (shoal_torch_built_for says which PyTorch it was built for).
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "graph_pools.h"
#include "ipc_handles.h"
#include "memory_history.h"
#include "oom_observers.h"
#include "plugin_status.h"
#include "trace_trackers.h"
#include "torch_api.h"

namespace {

namespace pluggable = torch::cuda::CUDAPluggableAllocator;
using c10::CachingDeviceAllocator::DeviceStats;

const shoal_torch_api* api = nullptr;
shoal_torch::graph_pools* graphs = nullptr;  // made at install, never destroyed (tensors outlive modules)
shoal_torch::memory_history* history = nullptr;  // made at install, never destroyed (it holds Python stacks)
shoal_torch::oom_observers* ooms = nullptr;  // made at install, never destroyed (it holds Python callables)
shoal_torch::trace_trackers* trackers = nullptr;  // made at install, never destroyed (as ooms)

void check(int status, const char* what) { shoal_torch::check(*api, status, what); }

// Set in a fork() child of a process that had asked shoal for memory
// (pthread_atfork, at install): CUDA is its parent's, the child allocates
// nothing, and every block it frees was inherited from the parent's pools,
// which the child's allocator refuses. Those drops (a DataLoader worker's,
// at its exit) do nothing: no lock a parent thread held at the fork, no
// CUDA stream lookup, no message per tensor. A child of a process that
// never allocated has no such block; its frees go on as in any process
// (PyTorch refuses CUDA in a child once the plugin is enabled, seen on the
// H100: "Cannot re-initialize CUDA in forked subprocess").
std::atomic<bool> asked_for_memory{false};
std::atomic<bool> forked_child{false};

/// A block from shoal; `pool`, when given, receives the MempoolId of the
/// graph pool it comes from ({0, 0}: the ordinary pools).
void* allocate_from_shoal(size_t bytes, int device, cudaStream_t stream, c10::cuda::MempoolId_t* pool) {
  if (!asked_for_memory.load(std::memory_order_relaxed)) asked_for_memory.store(true, std::memory_order_relaxed);
  if (graphs->routing()) return graphs->allocate(bytes, device, stream, pool);
  void* ptr = nullptr;
  int status = api->allocate(bytes, device, stream, &ptr);
  // Memory pools released while blocks of them were allocated go back now.
  if (status == SHOAL_TORCH_OUT_OF_MEMORY && graphs->destroy_released()) {
    status = api->allocate(bytes, device, stream, &ptr);
  }
  check(status, "allocate");
  return ptr;
}

/// The device's free memory as the driver reports it (0 when it cannot say).
size_t device_free_memory(int device) noexcept {
  try {
    const c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(device));
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess) return free;
    (void)cudaGetLastError();
  } catch (...) {
  }
  return 0;
}

// While memory history is recorded: the allocation and its "alloc" entry, or
// the "oom" entry of a refusal. The context is gathered first, with no lock
// held (the recorder may take the GIL).
void* allocate_recorded(size_t bytes, int device, cudaStream_t stream) {
  shoal_torch::allocation block{nullptr, bytes, device, stream, {0, 0}};
  shoal_torch::context context = history->allocation_context();
  try {
    const shoal_torch::memory_history::segments_for segments_made_for(context);
    block.ptr = allocate_from_shoal(bytes, device, stream, &block.pool);
  } catch (const c10::OutOfMemoryError&) {
    history->out_of_memory(block, device_free_memory(device), std::move(context));
    throw;
  }
  history->allocated(block, std::move(context));
  return block.ptr;
}

// shoal's segment observer (observe_segments): a segment event while
// memory history is recorded is its entry. Runs under shoal's locks.
void segment_changed(const shoal_torch_segment_event* event) noexcept {
  const bool recording = history->recording();
  if (!recording && !trackers->any()) return;
  using entry = shoal_torch::trace_entry;
  entry::Action action = entry::SEGMENT_ALLOC;
  switch (event->action) {
    case SHOAL_TORCH_SEGMENT_FREE: action = entry::SEGMENT_FREE; break;
    case SHOAL_TORCH_SEGMENT_MAP: action = entry::SEGMENT_MAP; break;
    case SHOAL_TORCH_SEGMENT_UNMAP: action = entry::SEGMENT_UNMAP; break;
    default: break;
  }
  const auto stream = static_cast<cudaStream_t>(event->stream);
  // NCCL's hook registers a MemPool's later segments by this name (register_mem_pool).
  const shoal_torch::mempool_id pool =
      event->private_pool != 0 ? graphs->id_of(event->device, event->private_pool) : shoal_torch::mempool_id{0, 0};
  if (trackers->any()) {
    trackers->notify(entry(action, static_cast<c10::DeviceIndex>(event->device), event->address, event->size,
                           static_cast<void*>(stream), pool, c10::getApproximateTime(), nullptr));
  }
  if (recording) history->segment_changed(action, event->device, event->address, event->size, stream, pool);
}

// shoal's free-wait observer (observe_free_waits): a free that waits for
// streams completes in the history when its wait is over. Runs under
// shoal's locks.
void free_wait_changed(const shoal_torch_free_wait_event* event) noexcept {
  if (!history->recording()) return;
  if (event->action == SHOAL_TORCH_FREE_HELD) {
    history->free_held(event->device, event->address);
  } else {
    history->free_wait_over(event->device, event->address);
  }
}

/// The share of `device`'s memory its allocator may reserve (0 when it cannot say).
double memory_fraction_of(int device) noexcept {
  try {
    return c10::cuda::CUDACachingAllocator::get()->getMemoryFraction(static_cast<c10::DeviceIndex>(device));
  } catch (...) {
    return 0;
  }
}

// A refusal is told to the out-of-memory observers (after history's "oom"
// entry, as PyTorch's allocator orders them) before the error goes on.
void* allocate_block(size_t bytes, int device, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  try {
    if (history->recording()) return allocate_recorded(bytes, device, stream);
    return allocate_from_shoal(bytes, device, stream, nullptr);
  } catch (const c10::OutOfMemoryError&) {
    ooms->notify(device, bytes, memory_fraction_of(device));
    throw;
  }
}

// Runs in tensors' deleters, which must not throw: a failure is reported on
// stderr and the block stays allocated.
// A block's free on the current stream of its device: the table's status.
// Throws PyTorch's error when the capture mode cannot be switched.
int release_block(void* ptr, int device) {
  std::optional<shoal_torch::memory_history::free_scope> recorded;  // until shoal took the block back
  if (history->recording()) recorded.emplace(*history, ptr);
  const cudaStream_t current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  return graphs->routing() ? graphs->deallocate(ptr, device, current) : api->deallocate(ptr, device, current);
}

void free_block(void* ptr, size_t /*bytes*/, int device, cudaStream_t /*allocation_stream*/) noexcept {
  if (ptr == nullptr || forked_child.load(std::memory_order_relaxed)) return;
  try {
    if (release_block(ptr, device) != SHOAL_TORCH_OK) {
      std::fprintf(stderr, "shoal: freeing a PyTorch block failed: %s\n", api->last_error());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal: freeing a PyTorch block failed: %s\n", e.what());
  }
}

// A tensor's DataPtr carries its device in the low bits of its context
// (blocks are 512-byte aligned and devices number fewer than 64), so its
// free needs no lookup; PyTorch's pluggable wrapper would keep every pointer
// in a map under a lock instead (raw_alloc and raw_delete still do).
constexpr std::uintptr_t block_alignment = 512;
constexpr std::uintptr_t device_mask = 63;

void free_tensor_block(void* context) noexcept {
  const auto bits = reinterpret_cast<std::uintptr_t>(context);
  free_block(reinterpret_cast<void*>(bits & ~(block_alignment - 1)), 0, static_cast<int>(bits & device_mask), nullptr);
}

void copy(const shoal_torch_stat (&from)[3], c10::CachingAllocator::StatArray& to) {
  for (int i = 0; i < 3; ++i) {
    to[i].current = from[i].current;
    to[i].peak = from[i].peak;
    to[i].allocated = from[i].allocated;
    to[i].freed = from[i].freed;
  }
}

// PyTorch's snapshot structs moved between namespaces and changed their
// field types across versions (int64_t or size_t sizes, cudaStream_t or
// void* streams): they are named through SnapshotInfo, and every field is
// set by a cast to its own type.
using snapshot_info = c10::cuda::CUDACachingAllocator::SnapshotInfo;
using segment_info = decltype(snapshot_info::segments)::value_type;
using block_info = decltype(segment_info::blocks)::value_type;
using pool_ids = std::map<std::pair<int, std::uint64_t>, c10::cuda::MempoolId_t>;

template <class Field, class Value>
void set(Field& field, Value value) {
  field = static_cast<Field>(value);
}

// As PyTorch's allocator fills a block's info: active while the block may
// not be handed out (allocated, or freed and waiting for a stream). A forced
// clear's tombstone, neither in use nor reusable, is counted as memory_stats
// counts it: not active (so segments' active sizes add up to active_bytes).
block_info block_info_of(const shoal_torch_block& block) {
  block_info out{};
  set(out.size, block.size);
  set(out.requested_size, block.requested_size);
  out.gc_counter = 0;
  out.allocated = block.state == SHOAL_TORCH_BLOCK_ALLOCATED;
  out.active = block.state == SHOAL_TORCH_BLOCK_ALLOCATED || block.state == SHOAL_TORCH_BLOCK_PENDING_FREE;
  return out;
}

// The order segments were taken in, where PyTorch's segment info has it
// (NCCL's register_mem_pool refuses a segment without one, and sorts a
// pool's segments by it). Sequence 0 (none) leaves PyTorch's "unset".
template <class Info>
void set_registration_counter(Info& out, std::uint64_t sequence) {
  if (sequence == 0) return;
  if constexpr (requires { out.registration_counter; }) {
    using counter = decltype(out.registration_counter);
    set(out.registration_counter, std::min<std::uint64_t>(sequence, std::numeric_limits<counter>::max()));
  }
}

// As PyTorch's allocator fills a segment's info: its sizes are sums over
// its blocks (requested over the active ones). Its pool is named later.
segment_info segment_info_of(const shoal_torch_segment& segment, const shoal_torch_block* blocks, size_t count) {
  segment_info out{};
  set(out.device, segment.device);
  set(out.address, segment.address);
  set(out.total_size, segment.total_size);
  set(out.stream, segment.stream);
  out.is_large = segment.is_large != 0;
  out.is_expandable = segment.is_expandable != 0;
  set_registration_counter(out, segment.sequence);
  size_t allocated = 0, active = 0, requested = 0;
  for (size_t i = 0; i < count; ++i) {
    block_info block = block_info_of(blocks[i]);
    if (block.allocated) allocated += blocks[i].size;
    if (block.active) {
      active += blocks[i].size;
      requested += blocks[i].requested_size;
    }
    out.blocks.push_back(std::move(block));
  }
  set(out.allocated_size, allocated);
  set(out.active_size, active);
  set(out.requested_size, requested);
  return out;
}

struct read_segment_info {
  int device;
  std::uint64_t private_pool;  ///< shoal's handle (0: none)
  segment_info info;
};

// What the table's snapshot gives each segment to.
struct snapshot_reader {
  std::vector<read_segment_info> segments;
  std::exception_ptr failure;  ///< the first one; the walk stops at it
};

int read_segment(void* context, const shoal_torch_segment* segment, const shoal_torch_block* blocks,
                 size_t count) noexcept {
  auto& reader = *static_cast<snapshot_reader*>(context);
  try {
    reader.segments.push_back({segment->device, segment->private_pool, segment_info_of(*segment, blocks, count)});
    return 0;
  } catch (...) {
    reader.failure = std::current_exception();
    return 1;
  }
}

/// Every segment of every device, as PyTorch's segment infos (no pool named yet).
std::vector<read_segment_info> read_snapshot() {
  snapshot_reader reader;
  const int status = api->snapshot(&reader, &read_segment);
  if (reader.failure) std::rethrow_exception(reader.failure);
  check(status, "memory_snapshot");
  return std::move(reader.segments);
}

/// The segments of memory pool `only` ({0, 0}: every pool), each named by
/// its pool's MempoolId, sorted as PyTorch's allocator sorts them (by
/// device, then address). `ids` must hold the ids read both before and after
/// the snapshot: a pool a segment names was made before the snapshot, and if
/// its memory went back (its id forgotten) before the second read, the first
/// one has it.
std::vector<segment_info> segments_of_pool(std::vector<read_segment_info> read, const pool_ids& ids,
                                           c10::cuda::MempoolId_t only) {
  const bool every_pool = only.first == 0 && only.second == 0;
  std::vector<segment_info> out;
  for (read_segment_info& r : read) {
    const auto owner = ids.find({r.device, r.private_pool});
    if (r.private_pool != 0 && owner != ids.end()) r.info.owner_private_pool_id = owner->second;
    if (every_pool || r.info.owner_private_pool_id == only) out.push_back(std::move(r.info));
  }
  std::sort(out.begin(), out.end(), [](const segment_info& a, const segment_info& b) {
    return std::pair(a.device, a.address) < std::pair(b.device, b.address);
  });
  return out;
}

class shoal_allocator final : public pluggable::CUDAPluggableAllocator {
 public:
  /// `previous`: the allocator PyTorch had before (see getIpcDevPtr).
  explicit shoal_allocator(c10::cuda::CUDACachingAllocator::CUDAAllocator* previous)
      : CUDAPluggableAllocator(allocate_block, free_block), previous_(previous) {}

  std::string name() override { return "shoal"; }

  c10::DataPtr allocate(size_t bytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    void* ptr = allocate_block(bytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
    const c10::Device where(c10::DeviceType::CUDA, device);
    // An empty storage carries the tensor deleter too, as under PyTorch's
    // allocator (CUDA graph trees compare deleters with raw_deleter()).
    if (ptr == nullptr) return {nullptr, nullptr, &free_tensor_block, where};
    const auto bits = reinterpret_cast<std::uintptr_t>(ptr);
    TORCH_INTERNAL_ASSERT((bits & (block_alignment - 1)) == 0 && static_cast<std::uintptr_t>(device) <= device_mask);
    return {ptr, reinterpret_cast<void*>(bits | static_cast<std::uintptr_t>(device)), &free_tensor_block, where};
  }

  // A tensor's context is its pointer with the device in the low bits: still
  // a simple data pointer (torch._lazy_clone's copy-on-write checks it).
  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override {
    const auto context = reinterpret_cast<std::uintptr_t>(data_ptr.get_context());
    if (data_ptr.get_deleter() == &free_tensor_block) {
      return reinterpret_cast<std::uintptr_t>(data_ptr.get()) == (context & ~(block_alignment - 1));
    }
    return data_ptr.get() == data_ptr.get_context();
  }

  // Device `dev` reads and writes `dev_to_access`'s memory: the runtime's
  // peer access (cudaMalloc'd plain segments need no more), then access to
  // `dev_to_access`'s growable segments, which cuMemSetAccess must grant
  // device by device, now and for every chunk mapped later — as PyTorch's
  // allocator does for its expandable segments.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    CUDAPluggableAllocator::enablePeerAccess(dev, dev_to_access);
    check(api->grant_peer_access(dev_to_access, dev), "enablePeerAccess");
  }

  // Without peer access, a copy between devices of memory that is not
  // cudaMalloc'd (growable segments) must go through cudaMemcpyPeerAsync:
  // cudaMemcpyAsync refuses it.
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr) return;
    const int status = api->record_stream(ptr.get(), ptr.device().index(), stream.stream());
    // A tensor over memory this allocator did not hand to PyTorch: inside a
    // shoal block (a transfer engine's array through DLPack) the block's
    // free waits for the stream; elsewhere (another library's memory) it is
    // ignored, as PyTorch's own allocator ignores pointers it did not make.
    if (status == SHOAL_TORCH_INVALID_ARGUMENT && ptr.get_deleter() != &free_tensor_block) return;
    check(status, "record_stream");
  }

  // torch.cuda.empty_cache() names no pool: everything cached goes back.
  // PyTorch's ~MemPool names its pool after releasing it: only a released
  // pool's memory goes, never the rest of the cache.
  // While history is recorded, the segments given back carry the caller's
  // stack at context='all', as PyTorch's allocator records them.
  void emptyCache(c10::cuda::MempoolId_t pool) override {
    const shoal_torch::context caller = history->recording() ? history->release_context() : nullptr;
    const shoal_torch::memory_history::segments_for given_back_for(caller);
    (void)graphs->destroy_released();
    if (pool.first != 0 || pool.second != 0) return;
    check(api->empty_cache(), "empty_cache");
  }

  // As PyTorch's allocator answers: the largest of a first guess (the
  // device's free memory when the caller gives none) and the cached free
  // blocks of the device.
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    if (*largest == 0) {
      const c10::cuda::CUDAGuard on_device(device);
      size_t total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(largest, &total));
    }
    size_t cached = 0;
    check(api->largest_free_block(device, &cached), "cacheInfo");
    *largest = std::max(*largest, cached);
  }

  // PyTorch's sharing sets the storage's device current before it asks.
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    return shoal_torch::share_ipc_handle(*api, ptr, c10::cuda::current_device());
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return shoal_torch::open_ipc_handle(handle, previous_);
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(api->set_memory_fraction(fraction, device), "set_per_process_memory_fraction");
    std::lock_guard lock(fractions_mutex_);
    fractions_[device] = fraction;
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard lock(fractions_mutex_);
    const auto found = fractions_.find(device);
    if (found != fractions_.end()) return found->second;
    double configured = 0;  // memory_fraction in SHOAL_ALLOC_CONF or enable()'s settings
    check(api->configured_memory_fraction(&configured), "get_per_process_memory_fraction");
    return configured > 0 ? configured : 1.0;
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    shoal_torch_stats s{};
    check(api->get_stats(device, &s), "memory_stats");
    DeviceStats out;
    copy(s.allocation, out.allocation);
    copy(s.segment, out.segment);
    copy(s.active, out.active);
    copy(s.inactive_split, out.inactive_split);
    copy(s.allocated_bytes, out.allocated_bytes);
    copy(s.reserved_bytes, out.reserved_bytes);
    copy(s.active_bytes, out.active_bytes);
    copy(s.inactive_split_bytes, out.inactive_split_bytes);
    copy(s.requested_bytes, out.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    return out;
  }

  // torch.cuda.memory_snapshot() and torch.cuda.memory._snapshot(): every
  // device's segments and blocks (of one memory pool when `mempool_id` names
  // one); the blocks allocated while history was recorded carry their stack.
  // With traces asked for, each device's recorded history (empty when none
  // is recorded); none otherwise, as PyTorch's own allocator answers. A
  // block freed and allocated again between the segments' read and the
  // stacks' shows the newer allocation's stack.
  snapshot_info snapshot(c10::cuda::MempoolId_t mempool_id, bool include_traces) override {
    pool_ids ids = graphs->ids();
    std::vector<read_segment_info> read = read_snapshot();
    ids.merge(graphs->ids());  // the pools made meanwhile; those already known keep their entry
    snapshot_info out{};
    out.segments = segments_of_pool(std::move(read), ids, mempool_id);
    history->add_contexts(out.segments);
    if (include_traces) out.device_traces = history->traces(static_cast<size_t>(c10::cuda::device_count()));
    return out;
  }

  // torch.cuda.memory._record_memory_history (memory_history.h).
  void recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, c10::cuda::CUDACachingAllocator::RecordContext when,
                     bool clear_history, const std::vector<std::string>& skip_actions) override {
    // One switch at a time, so recording and shoal's telling of frees that
    // wait (only while recording: such a free pays nothing for it otherwise)
    // go on and off together.
    static std::mutex switching;
    const std::lock_guard lock(switching);
    history->configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history, skip_actions);
    const int status = api->observe_free_waits(enabled ? &free_wait_changed : nullptr);
    if (status != SHOAL_TORCH_OK && enabled) {
      history->configure(false, nullptr, 1, c10::cuda::CUDACachingAllocator::RecordContext::NEVER, true, {});
    }
    check(status, "memory history");
  }

  bool isHistoryEnabled() override { return history->recording(); }

  // ProcessGroupNCCL's segment registration, among PyTorch's own users (trace_trackers.h).
  // PyTorch turns NCCL's hook off under its own expandable segments (it
  // registers whole segments and ignores segment_map / segment_unmap); it
  // cannot see shoal's, so the tracker is refused there rather than leave
  // NCCL registrations of memory given back.
  void attachAllocatorTraceTracker(c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) override {
    int growable = 0;
    check(api->configured_growable_segments(&growable), "attachAllocatorTraceTracker");
    TORCH_CHECK(growable == 0,
                "shoal: an allocator trace tracker (NCCL's allocator hook: ProcessGroupNCCL.register_mem_pool, "
                "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK) cannot follow shoal's growable segments, as "
                "PyTorch's own allocator does not follow its expandable segments; call "
                "shoal.torch.enable(expandable_segments=False) first, before anything starts CUDA, to use it");
    trackers->attach(std::move(tracker));
  }

  // torch._C._cuda_attach_out_of_memory_observer (oom_observers.h).
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    ooms->attach(std::move(observer));
  }

  void resetPeakStats(c10::DeviceIndex device) override { check(api->reset_peak_stats(device), "reset_peak_memory_stats"); }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(api->reset_accumulated_stats(device), "reset_accumulated_memory_stats");
  }

  // CUDA graphs and memory pools (graph_pools.h).
  void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    graphs->begin(device, id, std::move(filter));
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override { graphs->end(device, id); }

  void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override { graphs->release(device, id); }

  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                          std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "shoal: a torch.cuda.MemPool with an allocator of its own cannot be used while shoal is PyTorch's "
                "allocator (shoal would have to call that allocator for the pool's segments); make the pool "
                "without one, and it allocates from shoal");
    graphs->create_or_incref(device, id);
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    return graphs->use_count(device, id);
  }

  // A pool used when the rest of the device is out of memory would need a
  // fallback from shoal's ordinary pools into this one: not offered.
  void setUseOnOOM(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*id*/, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom,
                "shoal: torch.cuda.MemPool(use_on_oom=True) is not supported while shoal is PyTorch's allocator: "
                "a pool's memory serves only the allocations routed to it");
  }

  // Checkpoints of a pool's layout, which the CUDA graph trees of
  // torch.compile(mode="reduce-overhead") take after each capture and
  // restore when a new graph is warmed up or recorded while a path replays
  // (graph_pools.h).
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, at::cuda::MempoolId_t id) override {
    return graphs->checkpoint(device, id);
  }

  // The blocks the restore freed are no one's any more (PyTorch swaps their
  // storages' deleters for none); those it allocated again come back as
  // DataPtrs of tensors (PyTorch gives them to the storages that hold them,
  // and frees the rest with raw_delete).
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> state) override {
    TORCH_CHECK(state != nullptr, "shoal: setCheckpointPoolState was given no checkpoint");
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    const c10::Device where(c10::DeviceType::CUDA, device);
    graphs->restore(
        device, *state,
        [&](size_t freed, size_t allocated) {
          delta.ptrs_freed.reserve(freed);
          delta.dataptrs_allocd.reserve(allocated);
        },
        [&](void* freed) {
          if (history->recording()) shoal_torch::memory_history::free_scope recorded(*history, freed);
          delta.ptrs_freed.push_back(freed);
        },
        [&](void* allocated, size_t bytes, cudaStream_t stream, at::cuda::MempoolId_t pool) {
          const auto bits = reinterpret_cast<std::uintptr_t>(allocated);
          delta.dataptrs_allocd.emplace_back(allocated, reinterpret_cast<void*>(bits | static_cast<std::uintptr_t>(device)),
                                             &free_tensor_block, where);
          if (history->recording()) {
            history->allocated({allocated, bytes, device, stream, pool}, history->allocation_context());
          }
        });
    return delta;
  }

  // What PyTorch compares a storage's deleter with before it swaps it (CUDA
  // graph trees) or calls it a standard one: a tensor's, allocate()'s.
  c10::DeleterFnPtr raw_deleter() const override { return &free_tensor_block; }

  // raw_alloc's pointers are in the pluggable wrapper's map; any other is a
  // tensor's block (CUDA graph trees free those a restore allocated again
  // and no storage took), on the device its address belongs to.
  void raw_delete(void* ptr) override {
    if (ptr == nullptr || forked_child.load(std::memory_order_relaxed)) return;
    bool raw = false;
    {
      std::lock_guard lock(allocator_mutex_);
      raw = allocation_metadata_.count(ptr) != 0;
    }
    if (raw) {
      CUDAPluggableAllocator::raw_delete(ptr);
      return;
    }
    cudaPointerAttributes attributes{};
    C10_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
    TORCH_CHECK(attributes.type == cudaMemoryTypeDevice, "shoal: raw_delete of ", ptr,
                ", which is not CUDA device memory");
    check(release_block(ptr, attributes.device), "raw_delete");  // an unknown pointer raises, as PyTorch's allocator
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                                const std::unordered_set<void*>& expected_live_allocations) override {
    return graphs->live_blocks_are(device, id, expected_live_allocations);
  }

 private:
  c10::cuda::CUDACachingAllocator::CUDAAllocator* const previous_;
  std::mutex fractions_mutex_;
  std::unordered_map<c10::DeviceIndex, double> fractions_;  // guarded by fractions_mutex_
};

}  // namespace

/// The PyTorch version the plugin was built against (torch.__version__).
extern "C" __attribute__((visibility("default"))) const char* shoal_torch_built_for() { return SHOAL_TORCH_BUILT_FOR; }

extern "C" __attribute__((visibility("default"))) int shoal_torch_install(const shoal_torch_api* table, char* error,
                                                                          size_t error_size) {
  auto fail = [&](const std::string& message) {
    std::snprintf(error, error_size, "%s", message.c_str());
    return 1;
  };
  if (table == nullptr || table->version != SHOAL_TORCH_API_VERSION || table->struct_size != sizeof(shoal_torch_api)) {
    return fail("the shoal extension and its PyTorch plugin come from different builds; reinstall shoal");
  }
  const auto in_child = [] {
    forked_child.store(asked_for_memory.load(std::memory_order_relaxed), std::memory_order_relaxed);
  };
  if (const int failed = pthread_atfork(nullptr, nullptr, in_child); failed != 0) {
    return fail("pthread_atfork failed: " + std::string(std::strerror(failed)));
  }
  try {
    api = table;
    graphs = new shoal_torch::graph_pools(*table);
    history = new shoal_torch::memory_history();
    ooms = new shoal_torch::oom_observers();
    trackers = new shoal_torch::trace_trackers();
    check(table->observe_segments(&segment_changed), "observe_segments");
    // PyTorch's own allocators live as long as the process; one a program
    // installed itself is freed once replaced, so it opens nothing later.
    c10::cuda::CUDACachingAllocator::CUDAAllocator* previous = c10::cuda::CUDACachingAllocator::get();
    if (previous != nullptr && previous->name() != "native" && previous->name() != "cudaMallocAsync") previous = nullptr;
    pluggable::changeCurrentAllocator(std::make_shared<shoal_allocator>(previous));
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

// Measurement entry points for bench/python/torch_alloc.py: the cost of an
// allocate + free pair, in nanoseconds, on the calling thread's current
// stream of device 0, through PyTorch's allocator interface — (a) the
// tensor path, allocate() and the DataPtr's deleter, and (b) raw_alloc and
// raw_delete, which keep the pluggable wrapper's pointer map — for PyTorch's
// own allocator or shoal, whichever is installed; and (c) through shoal's
// table alone (installed only), which shows the interface's share.
namespace {

template <class Pair>
double nanoseconds_per_pair(int iterations, Pair&& pair) {
  for (int i = 0; i < 100; ++i) pair();  // warm the cache
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) pair();
  const std::chrono::duration<double, std::nano> spent = std::chrono::steady_clock::now() - start;
  return spent.count() / iterations;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) double shoal_torch_bench_raw_pairs(size_t bytes, int iterations) {
  return nanoseconds_per_pair(iterations, [bytes] {
    void* p = c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
    c10::cuda::CUDACachingAllocator::raw_delete(p);
  });
}

extern "C" __attribute__((visibility("default"))) double shoal_torch_bench_dataptr_pairs(size_t bytes, int iterations) {
  c10::Allocator* allocator = c10::cuda::CUDACachingAllocator::get();
  return nanoseconds_per_pair(iterations, [allocator, bytes] { c10::DataPtr p = allocator->allocate(bytes); });
}

extern "C" __attribute__((visibility("default"))) double shoal_torch_bench_table_pairs(size_t bytes, int iterations) {
  if (api == nullptr) return -1;
  void* stream = c10::cuda::getCurrentCUDAStream(0).stream();
  return nanoseconds_per_pair(iterations, [bytes, stream] {
    void* p = nullptr;
    if (api->allocate(bytes, 0, stream, &p) == SHOAL_TORCH_OK) api->deallocate(p, 0, stream);
  });
}
