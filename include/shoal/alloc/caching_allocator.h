// The stream-ordered caching allocator.
//
// Memory comes from a backend::device in segments and is handed out in
// blocks; freed blocks are cached and reused without going back to the
// device. Every block belongs to the stream it was allocated on.
//
// Stream-ordered reuse (the invariant everything else serves): a block is
// handed out again only when every stream that may touch it has passed its
// last use.
//   - deallocate(p, s) with s the block's own stream: reusable at once on s
//     (later work on s is ordered after earlier work).
//   - deallocate(p, s) with another stream s: an event is recorded on s and
//     the block waits ("pending free") until it completes. With
//     cross_stream_safety off, this hold is skipped (unsafe; for tests).
//   - record_stream(p, s): s is added to the streams the free waits for.
//   - Under memory pressure a pending block is made reusable early by making
//     its own stream wait on the event (a GPU-side wait) instead of
//     allocating more device memory.
// deallocate without a stream frees on the calling thread's current stream
// (backend::current_stream): right for a caller that used the block there
// and nowhere else; any other stream the block was used on must be given to
// record_stream, or the free passed that stream. It is no safety net:
// storages do not use it (a dropped storage frees on its own stream after
// every stream it was used on, not on the dropping thread's current stream;
// storage.h).
//
// Pinned host memory (config().memory == allocator_memory::pinned_host):
// the same allocator over device::allocate_pinned_host, for staging copies
// between the host and the device. Blocks are written and read by the CPU
// outside stream order, so every free holds its block until the freeing
// stream (and every record_stream stream) has passed the free, as seen from
// the host — also on the block's own stream, and with no GPU-side early
// reuse under pressure. memory_limit bounds the pinned footprint; when it is
// reached, allocation waits for pending frees before it gives up.
//
// Streams: a stream must outlive every block allocated on it and every free
// recorded on it (as on CUDA, where using a destroyed stream is undefined).
// The allocator keeps a pool per stream and holds each stream it allocated
// on (device::hold_stream): its owner may destroy it once its blocks are
// freed, and the stream is destroyed when the allocator lets it go, so that
// giving the pool's cached memory back (which synchronizes the stream) and
// handing a private-pool block last used on it out on another stream (which
// waits for it) still work, and no new stream takes its handle and its pool
// meanwhile. So are the streams a private pool's free blocks remember (a
// tombstone's late free's, record_stream's a restore keeps). A stream
// record_stream notes on a live block is held until that block's free has
// recorded its event there, so its owner may destroy it before that free. A
// stream otherwise only passed to deallocate is not held: it must outlive
// that free.
// A destroyed stream is let go once nothing of the allocator needs it any
// more: at the next allocation that is not a cached pair, when the stream
// is idle and none of its blocks is live or pending, or at empty_cache
// (which waits for its work and pending frees). Its pools keep the memory
// they cached, which the next new stream takes over (empty_cache gives it
// back), and the stream is destroyed. A stream with a live block, or noted
// on a live block by record_stream, stays held until that block is freed;
// a stream skipped so is looked at again after 16, 32, ... up to 1024
// allocations that are not cached pairs (outside no_host_waits_scope), at
// the next destroy of a stream something holds, and at empty_cache. A stream a private pool's block was handed out on (the
// pool's next hand-out waits for it) stays held until the allocator goes.
// So a stream per request does not pile up streams (host executor threads,
// CUDA cudaStream_t handles), and each request's stream starts with the
// cache of one before it.
//
// Processes: an allocator belongs to the process that made it. In a fork()
// child, allocate throws device_unavailable (its cached blocks are the
// parent's: on the host backend their bytes stay shared with the parent,
// which hands them out again) and deallocate does nothing (the memory is the
// parent's), nor do record_stream and the other steps of a drop, so a child
// drops what it inherited without taking a lock another of the parent's
// threads may have held at the fork; the calls that would use an inherited
// block or pool further (claim, block_size, sharing's marks, every private
// pool call) throw device_unavailable too. A child makes its own allocator, on a device it opened itself.
// The reports (stats(), take_snapshot(), ...) still read the inherited pools,
// and, as with any lock, wait for ever for a pool that another of the
// parent's threads was using at the fork: read them in a child only when the
// forking thread was the allocator's only user then.
//
// Thread-safety: every member may be called from any thread at once. Each
// stream's blocks have their own lock, so threads on different streams
// rarely contend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shoal/alloc/allocator_types.h"
#include "shoal/alloc/config.h"
#include "shoal/alloc/stats.h"
#include "shoal/backend/device.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::alloc {

namespace detail {
class __attribute__((visibility("hidden"))) allocator_core;  // hidden: the library's own
}
class caching_allocator;
namespace test_hook {
enum class invariant_breakage : std::uint8_t;
void unsafe_break_invariant(caching_allocator& allocator, void* ptr, invariant_breakage what);
}  // namespace test_hook

class caching_allocator {
 public:
  explicit caching_allocator(backend::device& device, allocator_config config = allocator_config::from_environment());
  /// Returns every segment to the device, once the work queued on them has
  /// run (the streams of its pools and of pending frees, debug poison
  /// included). Blocks still allocated then are the caller's leak; their
  /// memory is returned all the same.
  ~caching_allocator();
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  [[nodiscard]] backend::device& device() const noexcept;
  /// The settings in force: those given, except that expandable_segments
  /// is false where the device has no growable ranges and plain segments
  /// serve it instead (stats().expandable_segments_fallback).
  [[nodiscard]] const allocator_config& config() const noexcept;

  /// A block of at least `bytes` (> 0) for use on `stream`, 512-byte aligned.
  /// Inside a private_pool_scope, it comes from that pool. Throws
  /// out_of_memory when neither the cache nor the device can provide it.
  [[nodiscard]] void* allocate(std::size_t bytes, backend::stream_ref stream);
  /// allocate on the calling thread's current stream.
  [[nodiscard]] void* allocate(std::size_t bytes);
  /// allocate, with the block claimed (see claim) in the same step: for an
  /// owner that will free it (storages allocate this way).
  [[nodiscard]] void* allocate_claimed(std::size_t bytes, backend::stream_ref stream);
  /// Frees `ptr` with its last use enqueued on `stream` (see the header
  /// comment); nothing in a fork() child. A pointer this allocator did not hand out (nullptr
  /// too: unlike free(), a null free is taken for a caller's bug), or one already freed,
  /// gives invalid_argument and changes nothing. The late free of a
  /// block a forced clear took back (live_blocks::invalidate) removes its
  /// tombstone (even after its pool was destroyed) and frees nothing else.
  void deallocate(void* ptr, backend::stream_ref stream);
  /// deallocate on the calling thread's current stream.
  void deallocate(void* ptr);
  /// deallocate, for an owner that must let go (a destructor): where the
  /// host refuses the memory the free needs for its bookkeeping (a free on
  /// another stream than the block's, or after record_stream, takes some),
  /// it waits on the host for every stream that free would have waited
  /// for, then frees the block at once, instead of throwing std::bad_alloc
  /// with the block still allocated. Other errors as deallocate's. In a
  /// private pool and in debug mode making the block free takes memory too
  /// (the pool's last streams, the poison): refused there as well, it
  /// throws std::bad_alloc as deallocate does, the block still allocated.
  void deallocate_or_wait(void* ptr, backend::stream_ref stream);
  /// deallocate, but only when the free records no event: device memory,
  /// freed on the stream it was handed out on, with no other stream recorded
  /// on it (record_stream), or a tombstone's late free. Returns false and
  /// changes nothing otherwise (the block stays allocated). For frees during
  /// CUDA graph capture, where an event recorded on a capturing stream could
  /// not be queried: the caller frees such a block once the capture ended.
  [[nodiscard]] bool deallocate_without_events(void* ptr, backend::stream_ref stream);
  /// The block of `ptr` is also used on `stream`: its free waits for the
  /// work enqueued there until then. `ptr` may lie anywhere inside an
  /// allocated block (a part of storage::allocate_parts, a view's data): the
  /// whole block's free waits (found by a walk of its segment's blocks, so
  /// slower than for a block's start). On a block a forced clear took back
  /// (a tombstone) it does nothing: its owner's storage records its streams
  /// before the late free, which must still come to remove the tombstone.
  /// invalid_argument when `ptr` lies in no allocated block.
  void record_stream(void* ptr, backend::stream_ref stream);
  /// Bytes of the block that holds `ptr` (the rounded size).
  [[nodiscard]] std::size_t block_size(const void* ptr) const;
  /// The segment holding the allocated block that starts at `ptr`; nullopt
  /// when `ptr` starts no allocated block (a pointer inside one, a block
  /// freed or pending free, a tombstone, memory that is not the
  /// allocator's). Finds the pool as a free does — the one the calling
  /// thread's cache of recent segments names for `ptr`, else the segment
  /// directory's (then cached) — takes that one pool's lock, and copies
  /// nothing.
  [[nodiscard]] std::optional<block_segment> segment_of_allocated_block(const void* ptr) const;
  /// The allocated block at `ptr` is held outside this process (exported to
  /// another one): a forced clear of its private pool refuses to take it
  /// back. The mark lasts until unmark_held_outside or the block's free.
  /// invalid_argument for a pointer that is not a live block (a block a
  /// forced clear took back included), and nothing is marked.
  void mark_held_outside(void* ptr);
  /// Ends mark_held_outside: no other process holds the block any more. On a
  /// block a forced clear took back it does nothing; invalid_argument for a
  /// pointer that is no block at all.
  void unmark_held_outside(void* ptr);
  /// Records that the live block at `ptr` has one owner that will free it
  /// (storages claim the blocks they hold), so a second would-be owner is
  /// refused instead of freeing it twice: invalid_argument when the block is
  /// claimed already or `ptr` starts no live block. On a block a forced clear
  /// took back (a tombstone, perhaps between its allocation and this call) it
  /// does nothing. The claim ends with the block's free.
  void claim(void* ptr);

  /// Makes every pending free whose streams have passed reusable. Called by
  /// the allocator itself on a cache miss.
  void process_pending_frees();
  /// Waits for pending frees, then returns every cached segment (and every
  /// unused chunk of growable segments) to the device. The streams their
  /// owners destroyed whose blocks are all freed go too (see Streams above):
  /// their work and their awaiting frees are waited for first.
  void empty_cache();

  /// From now on, the allocator reserves at most `fraction` (0 < fraction
  /// <= 1) of the device's memory, in place of config().memory_fraction;
  /// 0 lifts that share (config().memory_limit still applies). Memory
  /// reserved past a lowered limit stays reserved until it is released
  /// (empty_cache, or a later growth's release of idle segments); until
  /// then no new segment is taken. Another value gives invalid_argument.
  void set_memory_fraction(double fraction);
  /// The reserved-bytes limit in force (allocator_config::no_limit: none).
  [[nodiscard]] std::size_t memory_limit() const noexcept;

  /// The counters, and a snapshot of every segment and block. Both show
  /// free blocks merged with their free neighbours (as they are merged
  /// before a request searches them) and change nothing: reading them never
  /// changes what the allocator does next. A destroyed private pool's
  /// counts stay in the totals (as freed): cumulative figures and peaks
  /// never go down until a reset. stats(), take_snapshot, the resets and
  /// largest_free_block look at each pool under its lock without taking
  /// the pool from the thread that uses it (one membarrier for all pools a
  /// read, whatever their number): polling them, even every millisecond,
  /// costs the allocating threads only the moment their pool is read.
  [[nodiscard]] allocator_stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  [[nodiscard]] snapshot take_snapshot() const;
  /// Bytes of the largest free block cached in the ordinary pools (every
  /// stream's, both size classes): the most that an allocation outside a
  /// private pool, on that block's stream, gets without asking the device
  /// (on another stream it may get less). 0 when none is cached.
  /// Counted as take_snapshot shows free blocks, merged with their free
  /// neighbours; blocks pending free, unbacked stretches of growable
  /// segments and private pools' free blocks (which serve only their own
  /// pool) are not counted. Looks at each ordinary pool under its lock
  /// (several at once, each let go once read), at its largest free-size bin
  /// and its at most quick_capacity parked blocks, and copies nothing; the
  /// figure may be stale by the time it returns.
  [[nodiscard]] std::size_t largest_free_block() const;
  /// The trace ring, oldest first (empty unless config().trace_entries > 0).
  [[nodiscard]] std::vector<trace_entry> trace() const;

  /// Called (on the allocating thread, with no allocator lock held) before
  /// out_of_memory is thrown; not again for an out-of-memory of an
  /// allocation an observer makes (on that thread, until it returns).
  /// Returns the id remove_oom_observer takes (ids of their own: not
  /// remove_hook's, nor the other way).
  std::uint64_t add_oom_observer(std::function<void(const oom_report&)> observer);
  /// Forgets observer `id` (one already called for an out-of-memory in
  /// progress on another thread may still run once); false when none has it.
  bool remove_oom_observer(std::uint64_t id);

  /// Recomputes the allocator's bookkeeping from its blocks and throws
  /// shoal::invariant_violation (naming the invariant, the segment and the
  /// block) unless: blocks tile each segment with no gap or overlap; a
  /// block is in the free bins iff it is free, mapped and not parked; no two
  /// neighbouring free blocks are both settled; every counter behind stats()
  /// equals the sum recomputed from the blocks; the segment directory holds
  /// exactly the live segments. Takes every pool's lock at once (all other
  /// calls wait), and costs time linear in the blocks held: for tests and
  /// debugging. Builds with SHOAL_CHECK_INVARIANTS=ON call it after every
  /// allocate, deallocate and release step. Changes nothing.
  void check_invariants() const;

  // ---- hooks for layers above (IPC) ----------------------------------------
  /// `hook` runs when the cache cannot serve a request, before the device is
  /// asked for more memory: on the allocating thread, with no allocator lock
  /// held, so it may free blocks. Returns an id for remove_hook.
  std::uint64_t add_cache_miss_hook(std::function<void()> hook);
  /// `hook` runs when a forced clear or destroy of a private pool
  /// (live_blocks::invalidate) starts, before it looks for blocks held
  /// outside: on the clearing thread, with no allocator lock held, so it
  /// may unmark blocks no other process holds any more (or free them).
  /// Returns an id for remove_hook.
  std::uint64_t add_forced_clear_hook(std::function<void()> hook);
  /// `observer(base, bytes)` is told whenever device memory the allocator
  /// held is about to be given back (a segment freed, chunks of a growable
  /// segment unmapped): the range is no longer the allocator's (no pointer
  /// into it is live, and it is out of the segment directory) but still
  /// mapped, so the observer can still act on it (say, forget an export of
  /// it); the device gets it back right after. It runs under a pool's lock:
  /// it must be quick and must not call the allocator. Returns an id for
  /// remove_hook.
  std::uint64_t add_release_observer(std::function<void(std::uintptr_t base, std::size_t bytes)> observer);
  /// `observer` is told of every segment event (segment_event) — a
  /// segment_alloc or segment_map once the memory is there, a segment_unmap
  /// once it is unmapped, a segment_free before the device has the memory
  /// back (still mapped; then another pool may be given the address) — on
  /// the thread that made it and possibly under an allocator
  /// lock: it must be quick and must not call the allocator; what it throws
  /// is dropped. The allocator's destruction, which gives everything back,
  /// tells none. With none registered, an event costs one relaxed load.
  /// Returns an id for remove_hook.
  std::uint64_t add_segment_observer(std::function<void(const segment_event&)> observer);
  /// `observer` is told when a free starts to wait for streams and when
  /// that wait is over (free_wait_event): `held` on the freeing thread,
  /// within deallocate, before the block can complete; `completed` on
  /// whichever thread finds the wait over (an allocation that misses its
  /// pool's cache, or one under memory pressure that has the pool's stream
  /// wait for it on the device; process_pending_frees, empty_cache; a
  /// private pool's drain, forget_last_streams, forced clear, destroy or
  /// restore_private_pool),
  /// under the block's pool lock, before the block can be handed out again. Same rules as a segment observer:
  /// quick, no call of the allocator, what it throws dropped, none told at
  /// the allocator's destruction, one relaxed load when none is registered.
  /// Returns an id for remove_hook.
  std::uint64_t add_free_wait_observer(std::function<void(const free_wait_event&)> observer);
  /// Removes a hook or observer; waits for calls of it in progress. An
  /// unknown id gives invalid_argument.
  void remove_hook(std::uint64_t id);

  // ---- private pools -----------------------------------------------------
  /// Inserts [base, base + bytes) of this device's memory, owned by the
  /// caller, as a private pool split into consecutive named sub-pools of the
  /// given sizes (one sub-pool named "" spanning all when `parts` is empty).
  /// The allocator never frees this memory. A region that overlaps memory
  /// the allocator manages already (another private pool's region, a
  /// segment its blocks come from) gives invalid_argument.
  private_pool_id create_private_pool(void* base, std::size_t bytes,
                                      const std::vector<std::pair<std::string, std::size_t>>& parts = {});
  /// A private pool of one sub-pool named "" that takes its memory from the
  /// device as it grows (plain segments of the standard sizes, under the
  /// limit; never growable ones), instead of from a region handed in. Its
  /// memory counts in stats().reserved_bytes and goes back to the device
  /// only with destroy_private_pool (live_blocks::refuse: invalidate is
  /// refused, here and by clear_private_pool), after the streams that used
  /// it have passed: empty_cache, out of memory and growth past the peak
  /// never give it back. For memory that must stay one user's until it says
  /// otherwise: a CUDA graph's pool, whose replays reuse the addresses its
  /// capture was handed, freed blocks included.
  private_pool_id create_growing_private_pool();
  /// drain_private_pool, then each free block of the sub-pool "" forgets the
  /// streams that last used it: its next hand-out waits for none of them.
  /// For pools whose users order their work among themselves: a CUDA graph
  /// pool before each capture (its graphs replay in capture order, and a
  /// wait inside a capture on a stream outside it is refused by CUDA).
  void forget_last_streams(private_pool_id pool);
  /// The start of every block of the pool that is allocated (not freed yet;
  /// a block freed on a stream that has not passed it is not listed).
  [[nodiscard]] std::vector<void*> private_pool_allocated_blocks(private_pool_id pool) const;
  /// Forgets every free block of the sub-pool (it becomes one free block
  /// again, split only around tombstones), freeing no device memory. With
  /// live_blocks::refuse, drains the sub-pool first (drain_private_pool;
  /// again, as long as frees came during the wait), then throws
  /// invalid_argument naming the live blocks when any block in it is
  /// allocated or pending. With invalidate, the
  /// whole device is synchronized first (again, as long as frees of the
  /// sub-pool came during the wait: their streams may still use it), then
  /// its pending frees are complete and its allocated blocks are taken
  /// back, each leaving a tombstone (see live_blocks), and reported. A
  /// block marked held outside refuses it (invalid_argument); whatever it
  /// throws, nothing was taken. Debug mode poisons the sub-pool on the
  /// default stream and waits for that before returning. Tombstones of
  /// earlier forced clears stay until their late frees.
  invalidated_blocks_report clear_private_pool(private_pool_id pool, const std::string& part = "",
                                               live_blocks live = live_blocks::refuse);
  /// Removes the pool; with live_blocks::refuse it must be clear of live
  /// blocks, and every sub-pool is drained first (drain_private_pool; again,
  /// as long as frees came during the wait), so that the memory leaves with
  /// no stream still using it; with invalidate every sub-pool's are taken back first (as
  /// clear_private_pool does; reported), all checked before any is taken:
  /// one block held outside refuses it and nothing is taken. In debug mode
  /// the memory's poison is written when this returns. Its tombstones
  /// outlive it, remembered by address: their late frees (and
  /// record_stream) are accepted and do nothing but forget them, and a
  /// private pool created over the same memory before then gets them back
  /// as tombstones, so no newer block starts there; so does a segment of
  /// this allocator's own that the device places over one (the memory left
  /// the process and its address was given out again), and a growable
  /// range over one is given back unused. Its id is invalid
  /// from then on (calls with it throw invalid_argument); no call with it
  /// may run meanwhile. Its bookkeeping serves a later private pool (so that
  /// inserting memory again costs no new pages); an allocation in a
  /// private_pool_scope of it that outlived it throws invalid_argument.
  invalidated_blocks_report destroy_private_pool(private_pool_id pool, live_blocks live = live_blocks::refuse);
  /// Waits on the host until the sub-pool's pending frees have completed and
  /// every stream that last used one of its free blocks has passed the work
  /// enqueued on it: clear_private_pool and destroy_private_pool do this
  /// themselves, so that they forget nothing a stream still reads or
  /// writes; on its own, for memory the caller is about to reuse. Blocks still
  /// allocated stay so (clear_private_pool then names them). Nobody should
  /// allocate from the sub-pool meanwhile.
  void drain_private_pool(private_pool_id pool, const std::string& part = "");
  /// The layout of a growing private pool now: every segment's blocks and
  /// which are allocated (pool_checkpoint; a free waiting for a stream and
  /// a tombstone count as free). For CUDA graph trees, which return a graph
  /// pool to the layout it had after an earlier capture (PyTorch's
  /// getCheckpointState). invalid_argument for a pool over memory handed in.
  /// Thread-safe; takes the pool's lock. Nobody should destroy the pool
  /// meanwhile.
  [[nodiscard]] pool_checkpoint checkpoint_private_pool(private_pool_id pool);
  /// Lays the growing private pool out as `checkpoint` says (PyTorch's
  /// setCheckpointPoolState): waits on the host for its pending frees (only
  /// those), frees every block allocated in it now (listed in
  /// `freed`: their owners must not free them), then splits each of the
  /// checkpoint's segments at its blocks' boundaries and allocates its
  /// allocated blocks again, with their requested sizes and streams (listed
  /// in `allocated`); segments taken since the checkpoint are left free. The
  /// streams of the allocated blocks wait on the device for every stream
  /// that used the pool's memory before (the old owners' queued work), and
  /// its free blocks remember those streams as their last. Throws
  /// invalid_argument before any block is freed or allocated (pending frees
  /// may have completed already) for a checkpoint of another pool,
  /// one whose segments the pool no longer has or whose blocks do not tile
  /// them, a pool that is not growing, a block shared with another process
  /// (mark_held_outside) and a tombstone in its memory (an orphan a new
  /// segment kept, until its late free); a device error while making the
  /// streams wait, and std::bad_alloc, also leave the layout as it was.
  /// Debug mode poisons what the restore leaves free, after every old user's
  /// work (a device error there leaves the layout as it was too, though
  /// memory it would have freed may hold the poison). Nobody should
  /// allocate from, free to or destroy the pool meanwhile.
  pool_restore_result restore_private_pool(private_pool_id pool, const pool_checkpoint& checkpoint);

 private:
  friend class private_pool_scope;
  friend void test_hook::unsafe_break_invariant(caching_allocator&, void*, test_hook::invariant_breakage);
  std::unique_ptr<detail::allocator_core> core_;
};

/// While it lives, this thread's allocations (from every caching_allocator)
/// never wait on the host and never give memory back: no cache-miss hook
/// runs, no idle segment goes back before a growth, and a miss that neither
/// the cache nor a new segment serves is out of memory at once (without
/// waiting for pending frees or emptying the cache). For allocations during
/// CUDA graph capture, where synchronizing a stream is refused and
/// invalidates the capture. Scopes nest.
class no_host_waits_scope {
 public:
  no_host_waits_scope() noexcept;
  no_host_waits_scope(const no_host_waits_scope&) = delete;
  no_host_waits_scope& operator=(const no_host_waits_scope&) = delete;
  ~no_host_waits_scope();
};

/// Directs this thread's allocations from `allocator` to a sub-pool of a
/// private pool while it lives. Scopes nest. A scope should end before its
/// pool is destroyed; an allocation in a scope that outlived its pool
/// throws invalid_argument (it never reaches a later pool).
class private_pool_scope {
 public:
  private_pool_scope(caching_allocator& allocator, private_pool_id pool, const std::string& part = "");
  private_pool_scope(const private_pool_scope&) = delete;
  private_pool_scope& operator=(const private_pool_scope&) = delete;
  ~private_pool_scope();

 private:
  caching_allocator& allocator_;
  void* previous_ = nullptr;
  std::uint64_t previous_generation_ = 0;
};

}  // namespace shoal::alloc

#pragma GCC visibility pop
