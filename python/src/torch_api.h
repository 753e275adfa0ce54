// The C interface between the shoal extension (_shoal), which owns the
// caching allocators PyTorch allocates from, and the PyTorch plugin
// (_shoal_torch), which is built against the installed PyTorch and installs
// them as PyTorch's CUDA allocator.
//
// Plain C across the boundary: the two libraries may be linked with
// different C++ runtimes (the extension hides its own), so no exception or
// standard-library object crosses it. Every function returns a status;
// on failure, last_error() holds the message for the calling thread until
// its next call that fails.
//
// Thread-safety: every function may be called from any thread, without the
// GIL; none touches Python.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHOAL_TORCH_API_VERSION 11

enum shoal_torch_status {
  SHOAL_TORCH_OK = 0,
  SHOAL_TORCH_OUT_OF_MEMORY = 1,
  SHOAL_TORCH_INVALID_ARGUMENT = 2,
  SHOAL_TORCH_ERROR = 3,
};

struct shoal_torch_stat {
  int64_t current, peak, allocated, freed;
};

/// One device's counters, laid out as PyTorch's DeviceStats: each array is
/// {all, small pool, large pool}.
struct shoal_torch_stats {
  struct shoal_torch_stat allocation[3], segment[3], active[3], inactive_split[3];
  struct shoal_torch_stat allocated_bytes[3], reserved_bytes[3], active_bytes[3], inactive_split_bytes[3];
  struct shoal_torch_stat requested_bytes[3];
  int64_t num_alloc_retries, num_ooms, num_device_alloc, num_device_free;
};

/// A block's state in a snapshot.
enum shoal_torch_block_state {
  SHOAL_TORCH_BLOCK_ALLOCATED = 0,     ///< handed out
  SHOAL_TORCH_BLOCK_PENDING_FREE = 1,  ///< freed, waiting for a stream to pass its last use
  SHOAL_TORCH_BLOCK_FREE = 2,          ///< cached, reusable
  /// A forced clear's tombstone (512 bytes): taken from its owner, whose
  /// free is still owed; neither in use nor reusable.
  SHOAL_TORCH_BLOCK_INVALIDATED = 3,
};

struct shoal_torch_block {
  size_t size;
  size_t requested_size;  ///< bytes asked for; 0 unless allocated or pending free
  int state;              ///< enum shoal_torch_block_state
};

/// A segment as PyTorch's snapshot shows one: a plain segment whole; a
/// growable segment one per stretch of it that memory backs, as PyTorch
/// shows its expandable segments. Its blocks cover it, in address order.
struct shoal_torch_segment {
  int device;
  uintptr_t address;
  size_t total_size;
  void* stream;        ///< its pool's cudaStream_t (NULL: the legacy default stream, or a graph pool's)
  int is_large;        ///< of the large pool (blocks over 1 MiB) rather than the small one
  int is_expandable;   ///< a stretch of a growable segment
  uint64_t private_pool; ///< the private pool it belongs to (a graph pool's create_graph_pool handle, or a
                        ///< region pool's id); 0: the ordinary pools
  uint64_t sequence;     ///< the order its allocator took its segments in (segment_snapshot::sequence).
                        ///< A growable segment's stretches share their segment's: no tie reaches
                        ///< NCCL's register_mem_pool, which sorts by it, as graph pools and MemPools
                        ///< take plain segments and its hook is refused over growable ones.
};

/// Called for each segment with its `count` blocks; returns 0 to go on,
/// anything else to stop. Must not throw.
typedef int (*shoal_torch_segment_visitor)(void* context, const struct shoal_torch_segment* segment,
                                           const struct shoal_torch_block* blocks, size_t count);

/// What a segment event did (caching_allocator::add_segment_observer).
enum shoal_torch_segment_action {
  SHOAL_TORCH_SEGMENT_ALLOC = 0,  ///< a plain segment taken from the device
  SHOAL_TORCH_SEGMENT_FREE = 1,   ///< a plain segment given back, whole
  SHOAL_TORCH_SEGMENT_MAP = 2,    ///< a stretch of a growable segment backed by memory
  SHOAL_TORCH_SEGMENT_UNMAP = 3,  ///< a stretch of a growable segment given back
};
struct shoal_torch_segment_event {
  int device;
  int action;  ///< enum shoal_torch_segment_action
  uintptr_t address;
  size_t size;
  void* stream;  ///< its pool's cudaStream_t (NULL: the legacy default stream, or none)
  uint64_t private_pool;  ///< the graph pool it belongs to (create_graph_pool's handle); 0: the ordinary pools
};
/// Told of a segment event on the thread that made it, possibly under an
/// allocator lock: it must be quick, must not call this table, must not throw
/// and must not wait for another thread (the GIL included: the tests' ctypes
/// observer takes it, which is safe only while one thread allocates).
typedef void (*shoal_torch_segment_observer)(const struct shoal_torch_segment_event* event);

/// What became of a free that waits for streams (caching_allocator::
/// add_free_wait_observer).
enum shoal_torch_free_wait_action {
  SHOAL_TORCH_FREE_HELD = 0,       ///< the free was called; the block waits for streams
  SHOAL_TORCH_FREE_COMPLETED = 1,  ///< the wait is over: the block is free again
};
struct shoal_torch_free_wait_event {
  int device;
  int action;  ///< enum shoal_torch_free_wait_action
  uintptr_t address;
  size_t size;   ///< the block's size (not the bytes asked for)
  void* stream;  ///< the block's own cudaStream_t (NULL: the legacy default stream)
};
/// Told of a free that waits: "held" on the freeing thread, within
/// deallocate (record_stream's or the freeing stream's wait); "completed" on
/// any thread, under an allocator lock, before the block is handed out
/// again. The same rules as a segment observer.
typedef void (*shoal_torch_free_wait_observer)(const struct shoal_torch_free_wait_event* event);

/// A block a graph pool's restore changed (restore_graph_pool).
enum shoal_torch_restored_action {
  SHOAL_TORCH_RESTORE_FREED = 0,      ///< was allocated, is not: its owner must not free it
  SHOAL_TORCH_RESTORE_ALLOCATED = 1,  ///< allocated again, as the checkpoint had it: the caller's to free
};
/// Told of each block a restore changed, after the restore, with no lock
/// held; returns nothing and must not throw. `size` and `stream` (the
/// cudaStream_t it was handed out on; NULL: the legacy default stream) only
/// for a block allocated again (0 and NULL for a freed one).
typedef void (*shoal_torch_restored_visitor)(void* context, int action, uintptr_t address, size_t size,
                                             void* stream);

struct shoal_torch_api {
  uint32_t version;     ///< SHOAL_TORCH_API_VERSION
  uint32_t struct_size; ///< sizeof(struct shoal_torch_api)
  /// *out = a block of `bytes` (> 0) of CUDA device `device` for use on
  /// `stream` (a cudaStream_t; NULL: the legacy default stream).
  int (*allocate)(size_t bytes, int device, void* stream, void** out);
  /// Frees `ptr` with its last use enqueued on `stream` (the freeing
  /// thread's current stream): reused only after that stream passes it.
  int (*deallocate)(void* ptr, int device, void* stream);
  /// `ptr` is used on `stream` too: its free waits for that stream as well.
  int (*record_stream)(void* ptr, int device, void* stream);
  /// Returns every cached segment of every device to the driver.
  int (*empty_cache)(void);
  /// The share of `device`'s memory its allocator may reserve (0: no share limit).
  int (*set_memory_fraction)(double fraction, int device);
  /// The counters, reset_peak_stats and reset_accumulated_stats of a device
  /// no allocation has reached yet are zeros and nothing: they make no
  /// allocator (and start no CUDA context) there.
  int (*get_stats)(int device, struct shoal_torch_stats* out);
  int (*reset_peak_stats)(int device);
  int (*reset_accumulated_stats)(int device);
  const char* (*last_error)(void);

  // CUDA graph pools (torch.cuda.graph, torch.cuda.MemPool): each a growing
  // private pool of `device`'s allocator (caching_allocator::
  // create_growing_private_pool), named by a nonzero handle.
  /// *out = a new pool's handle.
  int (*create_graph_pool)(int device, uint64_t* out);
  /// allocate, from pool `pool` (0: the device's ordinary pools), waiting on
  /// nothing (caching_allocator's no_host_waits_scope): for allocations while
  /// a capture may be underway.
  int (*allocate_in_pool)(uint64_t pool, size_t bytes, int device, void* stream, void** out);
  /// deallocate, only when the free records no event (caching_allocator::
  /// deallocate_without_events): *freed = 0, nothing changed, otherwise
  /// (a block another process may hold, too).
  int (*deallocate_without_events)(void* ptr, int device, void* stream, int* freed);
  /// Before allocations are routed to `pool` (before a capture begins): waits
  /// for its pending frees and the streams that last used its free blocks,
  /// then forgets those streams (caching_allocator::forget_last_streams).
  int (*settle_graph_pool)(uint64_t pool, int device);
  /// Gives the pool's memory back to the device; its handle is invalid
  /// after. *destroyed = 0, nothing changed, while a block of it is allocated.
  int (*destroy_graph_pool)(uint64_t pool, int device, int* destroyed);
  /// The starts of the pool's allocated blocks: the first `capacity` go to
  /// `out`, *count = how many there are.
  int (*graph_pool_allocated_blocks)(uint64_t pool, int device, void** out, size_t capacity, size_t* count);

  /// *out = the largest free block cached for `device` in its ordinary
  /// pools, which any allocation outside a graph pool may use (0 when none,
  /// or no allocation reached the device yet); graph pools' free blocks are
  /// not counted (caching_allocator::largest_free_block).
  int (*largest_free_block)(int device, size_t* out);
  /// The plain segment (one cudaMalloc allocation) holding the allocated
  /// block that starts at `ptr`: *base and *size. Refused
  /// (SHOAL_TORCH_INVALID_ARGUMENT, saying why) for a block of a growable
  /// segment or of memory handed in, and for a pointer that starts no
  /// allocated block.
  int (*block_segment)(void* ptr, int device, void** base, size_t* size);
  /// *out = the memory_fraction the allocators were configured with (0: none).
  int (*configured_memory_fraction)(double* out);
  /// Every segment of every device that has an allocator, each given to
  /// `visit` with `context`: one snapshot per device, all taken before the
  /// first visit (allocations meanwhile change none of it), and no lock held
  /// while `visit` runs. A visit that returns nonzero stops the walk, and
  /// this returns SHOAL_TORCH_ERROR.
  int (*snapshot)(void* context, shoal_torch_segment_visitor visit);
  /// `observe` (NULL: none) is told of every segment event of every
  /// device's allocator from now on, in place of the one set before.
  int (*observe_segments)(shoal_torch_segment_observer observe);
  /// `observe` (NULL: none) is told of every free that waits for streams,
  /// of every device's allocator, from now on, in place of the one set
  /// before. With none, such a free pays one relaxed load for it: set one
  /// only while it is wanted (the plugin's, while memory history records).
  int (*observe_free_waits)(shoal_torch_free_wait_observer observe);
  /// *out = 1 when the allocators were configured with growable segments
  /// (expandable_segments), else 0: the setting, also where a device without
  /// growable ranges falls back to plain segments.
  int (*configured_growable_segments)(int* out);

  // Checkpoints of a graph pool's layout (caching_allocator::
  // checkpoint_private_pool / restore_private_pool), for CUDA graph trees.
  /// *out = a new checkpoint of the pool, to give to free_graph_pool_checkpoint;
  /// *allocated_blocks = how many of its blocks are allocated (what a
  /// restore allocates again).
  int (*checkpoint_graph_pool)(uint64_t pool, int device, void** out, size_t* allocated_blocks);
  int (*free_graph_pool_checkpoint)(void* checkpoint);
  /// Lays the pool out as `checkpoint` (of this pool) says, then tells
  /// `visit` (not NULL: refused before anything changes) each block it
  /// freed and each it allocated again.
  int (*restore_graph_pool)(uint64_t pool, int device, const void* checkpoint, void* context,
                            shoal_torch_restored_visitor visit);

  /// Lets CUDA device `peer` reach `device`'s growable segments, those
  /// mapped now and later (backend::device::grant_peer_access; the runtime's
  /// peer access, which plain segments need, is the caller's).
  int (*grant_peer_access)(int device, int peer);
};

#ifdef __cplusplus
}
#endif
