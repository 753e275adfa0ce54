// The caching allocator's machinery behind caching_allocator's interface:
// the allocate and free policy, and the parts it is made of.
//
//   pool_directory   which pool serves a stream, a scope or a pointer; the
//                    lock order of all the allocator's locks is stated there
//   segment_source   device memory: growth, release, the limit
//   block_structure  split, merge, park and settle within a pool
//   event_pool       spare events for cross-stream frees
//   orphaned_tombstones  tombstones whose private pool was destroyed
//   trace_ring       the last N events
//   size_policy.h    request size -> block size, pool, segment; fit, split
//
// Thread-safety: every public member may be called from any thread at once.
// The allocation and free paths take one pool lock (plus, on a cache miss,
// the leaf locks of the parts above).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "alloc/allocator_hooks.h"
#include "alloc/block_pool.h"
#include "alloc/core_util.h"
#include "alloc/event_pool.h"
#include "alloc/orphaned_tombstones.h"
#include "alloc/pool_directory.h"
#include "alloc/segment_source.h"
#include "alloc/trace_ring.h"
#include "core/fork_epoch.h"
#include "shoal/alloc/allocator_types.h"
#include "shoal/alloc/config.h"
// Before the definition below, in every file: its declaration of
// allocator_core carries the hidden attribute, which GCC ignores (and warns
// about) on a declaration after the class is defined.
#include "shoal/alloc/caching_allocator.h"
#include "shoal/alloc/invariant_test_hook.h"
#include "shoal/alloc/late_free_test_hook.h"
#include "shoal/alloc/stats.h"
#include "alloc/held_streams.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

[[noreturn]] void throw_not_allocated(std::uintptr_t address, const char* op);
/// device_unavailable naming `op` in a fork() child of the process that made
/// the allocator (`epoch`): for the calls that would use what it inherited
/// further, before any lock, since another of the parent's threads may have
/// held it at the fork.
void refuse_in_fork_child(const shoal::detail::fork_epoch& epoch, const char* op);
/// Runs the tests' late free hook, when one is set (late_free_test_hook.cpp).
void run_late_free_hook(test_hook::late_free_step step);
/// Throws invalid_argument when `b` is a tombstone (a forced clear took it):
/// only its free is still accepted.
void require_not_invalidated(const block* b, const char* op);
/// A forced clear's first phase (forced_clear.cpp; pool locked): refuses
/// (invalid_argument naming `op` and them) when blocks of the sub-pool are
/// shared with another process (mark_held_outside), which a forced clear
/// never takes, and reserves room in `taken` for its allocated blocks.
/// Throws, changing nothing, or leaves take_back_live_blocks nothing to
/// fail on.
void prepare_take_back(const block_pool& part, const char* op, invalidated_blocks_report& taken);

/// True in builds with SHOAL_CHECK_INVARIANTS: the allocator checks its
/// invariants itself after every allocate, free and release step.
#ifdef SHOAL_CHECK_INVARIANTS
inline constexpr bool check_every_step = true;
#else
inline constexpr bool check_every_step = false;
#endif
/// check_every_step as the library was built (tests, built without the
/// library's definitions): each step then takes every pool's lock.
[[nodiscard]] bool library_checks_every_step() noexcept;

class allocator_core {
 public:
  allocator_core(backend::device& device, allocator_config config);
  ~allocator_core();
  allocator_core(const allocator_core&) = delete;
  allocator_core& operator=(const allocator_core&) = delete;

  backend::device& device;
  /// True when expandable_segments was asked for and the device has no
  /// growable ranges (device::growable()), so plain segments serve instead.
  const bool expandable_segments_fallback;
  /// The settings in force: as given, except that expandable_segments is
  /// false where expandable_segments_fallback is true.
  const allocator_config config;
  allocator_hooks hooks;

  /// With `claim`, the block is handed out claimed (see claim), under the
  /// same lock as the hand-out.
  void* allocate(std::size_t bytes, backend::stream_ref stream, bool claim = false);
  /// Without `events_allowed`, a free that would record an event (see
  /// caching_allocator::deallocate_without_events) is refused: false, and
  /// the block stays allocated. True otherwise.
  bool deallocate(void* ptr, backend::stream_ref stream, bool events_allowed = true);
  /// caching_allocator::deallocate_or_wait (free_after_host_wait.cpp).
  void deallocate_or_wait(void* ptr, backend::stream_ref stream);
  void record_stream(void* ptr, backend::stream_ref stream);
  [[nodiscard]] std::size_t block_size(const void* ptr) const;
  [[nodiscard]] std::optional<block_segment> segment_of_allocated_block(const void* ptr) const;  // cache_queries.cpp
  void mark_held_outside(void* ptr);
  void unmark_held_outside(void* ptr);
  void claim(void* ptr);
  void process_pending_frees();
  /// Gives every pool's cached memory back, and lets the streams their
  /// owners destroyed go (let_destroyed_streams_go, waiting).
  void empty_cache();
  void set_memory_fraction(double fraction);
  [[nodiscard]] std::size_t memory_limit() const noexcept { return source_.limit(); }

  // Reports show every free block merged as settling the quick lists would
  // leave it, without settling them: reading them changes nothing.
  [[nodiscard]] allocator_stats stats();
  void reset_peak_stats();
  void reset_accumulated_stats();
  [[nodiscard]] snapshot take_snapshot();
  [[nodiscard]] std::size_t largest_free_block() const;  // cache_queries.cpp
  [[nodiscard]] std::vector<trace_entry> trace() const;
  std::uint64_t add_oom_observer(std::function<void(const oom_report&)> observer);
  bool remove_oom_observer(std::uint64_t id);

  /// Throws invariant_violation unless every invariant holds (see
  /// invariant_checker.h); holds every pool's lock meanwhile.
  void check_invariants() const;
  /// check_invariants in builds with SHOAL_CHECK_INVARIANTS, after a step
  /// that changed the allocator; nothing in others. A check the host has no
  /// memory for is skipped: the step it follows has happened, and throwing
  /// std::bad_alloc would lose what it made (a block, a pool) to its caller.
  void check_step() const {
    if constexpr (check_every_step) {
      try {
        check_invariants();
      } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): not checked, nothing broken found
      }
    }
  }
  /// Tests only: breaks one invariant around the allocated block at `ptr`.
  void unsafe_break_invariant(void* ptr, test_hook::invariant_breakage what);

  private_pool_id create_private_pool(void* base, std::size_t bytes,
                                      const std::vector<std::pair<std::string, std::size_t>>& parts);
  private_pool_id create_growing_private_pool();
  void forget_last_streams(private_pool_id id);
  [[nodiscard]] std::vector<void*> private_pool_allocated_blocks(private_pool_id id) const;
  invalidated_blocks_report clear_private_pool(private_pool_id id, const std::string& part, live_blocks live);
  void drain_private_pool(private_pool_id id, const std::string& part);
  // Waits on the host for the pending frees of `part` and the streams that
  // last used its free blocks (its lock taken, and let go for the waits).
  void drain(block_pool& part);
  invalidated_blocks_report destroy_private_pool(private_pool_id id, live_blocks live);
  // Checkpoints of growing private pools (pool_checkpoints.cpp).
  [[nodiscard]] pool_checkpoint checkpoint_private_pool(private_pool_id id);
  pool_restore_result restore_private_pool(private_pool_id id, const pool_checkpoint& checkpoint);
  /// Where this thread's allocations are directed (part nullptr: nowhere).
  [[nodiscard]] pool_direction directed_pool() const noexcept { return directory_.directed_pool(); }
  /// Directs this thread's allocations to `to`; returns the previous one.
  pool_direction direct_to(pool_direction to) noexcept { return directory_.direct_to(to); }
  [[nodiscard]] pool_direction direction_to(private_pool_id id, const std::string& part) const {
    return directory_.direction_to(id, part);
  }
  [[nodiscard]] block_pool& private_part(private_pool_id id, const std::string& part) {
    return directory_.private_part(id, part);
  }

 private:
  /// Runs fn(pool, block) with the pool locked, for the allocated block or
  /// tombstone at `address`; false when there is none (a pending free or a
  /// parked block is not live). The block stays in the pool's index: fn
  /// takes it out when it settles the block into the bins.
  template <class Fn>
  bool run_on_block(std::uintptr_t address, Fn&& fn) const;
  /// run_on_block, throwing invalid_argument naming `op` when there is none.
  template <class Fn>
  void with_block(std::uintptr_t address, const char* op, Fn&& fn) const {
    if (!run_on_block(address, std::forward<Fn>(fn))) throw_not_allocated(address, op);
  }

  // ---- the allocation path (pool locked unless said otherwise)
  // How a miss may ask the device: not at all, for the standard segment
  // only, or also for a right-sized one (allocate_slow, after its cheaper steps).
  enum class growth { none, standard_segment, right_sized_allowed };
  /// One allocation being served: the block size, the bytes asked for, the
  /// stream, whether the block is handed out claimed, and the service
  /// generation the pool must have (a private_pool_scope's; 0 for a stream
  /// pool).
  struct request {
    std::size_t size;
    std::size_t requested;
    backend::stream_ref stream;
    bool claim;
    std::uint64_t generation;
  };
  /// allocate past its fast path (unlocked).
  void* allocate_general(std::size_t bytes, backend::stream_ref stream, bool claim);
  /// The request served from `pool` (unlocked): the first try, then the
  /// misses' steps; traced and checked. Out of line: see allocate.
  [[gnu::noinline]] void* allocate_from(block_pool& pool, const request& r);
  /// Whether the first try leaves growth to the cache-miss hooks (run
  /// before the device is asked, where host waits are allowed).
  [[nodiscard]] bool first_try_leaves_growth_to_hooks() const noexcept;
  /// After the first try missed (unlocked): the hooks, then the slow path;
  /// out_of_memory when nothing serves.
  block* allocate_after_miss(block_pool& pool, const request& r, bool hooks_first);
  block* try_allocate(block_pool& pool, const request& r, growth may_grow);
  block* allocate_slow(block_pool& pool, const request& r);  // unlocked
  /// Waits on the host for `pool`'s pending frees, oldest first, until a
  /// block of the request's size fits without growing; null when none is
  /// left to wait for.
  block* wait_for_own_pending(block_pool& pool, const request& r);  // unlocked
  /// A parked block of exactly `size`, else (parked blocks settled first)
  /// the best fit from the bins; not removed.
  block* take_cached(block_pool& pool, std::size_t size);
  block* take_free(block_pool& pool, std::size_t size) const;  // from the bins; not removed
  void hand_out(block_pool& pool, block* b, const request& r);
  /// hand_out of a block take_quick returned.
  void hand_out_parked(block_pool& pool, block* b, std::size_t requested, backend::stream_ref stream,
                       bool claim) noexcept;
  /// A block handed out, in its pool's counters (the invariant test hook
  /// counts with it too).
  SHOAL_HOT_INLINE static void count_hand_out(block_pool& pool, const block* b, std::size_t requested) noexcept {
    auto& c = pool.counters;
    const auto bytes = static_cast<std::int64_t>(b->size);
    pool_counters::add(c.allocations, 1);
    pool_counters::add(c.allocated_bytes, bytes);
    pool_counters::add(c.active, 1);
    pool_counters::add(c.active_bytes, bytes);
    pool_counters::add(c.requested_bytes, static_cast<std::int64_t>(requested));
  }
  [[noreturn]] void out_of_memory_error(block_pool& pool, std::size_t bytes, backend::stream_ref stream);

  // ---- the free path (pool locked)
  /// The free on its own stream, no other stream recorded, device memory:
  /// nothing to wait for in any mode (free_waiting holds nothing for it).
  [[nodiscard]] bool is_common_free(const block* b, backend::stream_ref stream) const noexcept;
  /// A common free of `b` would park it with no call: nothing to settle,
  /// room in the quick list, no trace.
  [[nodiscard]] bool parks_without_a_call(const block_pool& pool, const block* b) const noexcept;
  void free_common(block_pool& pool, block* b);
  /// The free of `b`, found allocated or a tombstone: the common one or
  /// free_waiting. Out of line, so the fast path's registers stay few.
  [[gnu::noinline]] bool free_found(block_pool& pool, block* b, backend::stream_ref stream, bool events_allowed);
  /// deallocate past its fast path: every pool, every kind of free.
  [[gnu::noinline]] bool deallocate_general(std::uintptr_t address, backend::stream_ref stream, bool events_allowed);
  /// Every free but the common one: tombstones, frees that wait for streams
  /// or events, pinned host memory. False when it is refused (see
  /// deallocate): nothing happened to `b`.
  bool free_waiting(block_pool& pool, block* b, backend::stream_ref stream, bool events_allowed);
  /// Frees `b`, every use of which has run (waited for on the host), with
  /// no event: what deallocate_or_wait does once it waited (on `stream`).
  void free_idle(block_pool& pool, block* b, backend::stream_ref stream);
  /// A free's effect on the counters and the block's allocation fields.
  static void count_free(block_pool& pool, block* b) noexcept;
  void make_reusable(block_pool& pool, block* b);
  /// What making `b` free may need from the device or the host, done first
  /// (debug mode's poison, room for settling's merges, `more_waits` waits
  /// it will carry in besides its own): std::bad_alloc or a device error
  /// here changes nothing. Called before make_reusable or make_free.
  void prepare_free(block_pool& pool, block* b, std::size_t more_waits = 0);
  [[gnu::noinline]] void prepare_settling_free(block_pool& pool, block* b, std::size_t more_waits);
  /// make_reusable of a block that waits for nothing (not pending). `b` is
  /// in the index, as every block outside the bins is; it leaves it only
  /// if it settles at once.
  void make_free(block_pool& pool, block* b);
  /// make_free's counts: `b` is no longer active.
  static void count_reusable(block_pool& pool, block* b) noexcept;
  /// Whether make_free settles `b` into the bins rather than park it.
  [[nodiscard]] bool settles_at_once(const block_pool& pool, const block* b) const noexcept;
  /// Puts a free block (state free) in the quick list, which has room.
  static void park(block_pool& pool, block* b) noexcept;
  void collect_pending(block_pool& pool, bool wait_on_device);

  // ---- forced clears (forced_clear.cpp; pool locked, device synchronized
  //      with no free since)
  /// The second phase, after prepare_take_back: every pending free of the
  /// sub-pool becomes free, every allocated block a tombstone appended to
  /// `taken`. Throws nothing. Leaves free blocks unmerged and the rest of
  /// each taken block unlinked: reset_layout or empty_for_reuse follows,
  /// under the same lock.
  void take_back_live_blocks(block_pool& part, invalidated_blocks_report& taken);
  /// record_stream of a pointer inside an allocated block: true when it
  /// found one (and noted the stream on it).
  bool record_inside_block(std::uintptr_t address, backend::stream_ref stream);
  /// Adds `stream` to the block's used_on (pool locked), and holds it on
  /// the device (hold_stream) until the block's free has recorded its event
  /// there (let_used_on_go): the free uses the stream after the call that
  /// named it, so its owner may destroy it meanwhile (a stream per request
  /// used on a transfer batch's or a sent storage's block, whose free comes
  /// when the owner lets go). Invariant: holds of the used_on entries ==
  /// non-default entries of every block's used_on. A throw changes nothing.
  void note_used_on(block_pool& pool, block* b, backend::stream_ref stream) {
    if (std::find(b->used_on.begin(), b->used_on.end(), stream) != b->used_on.end()) return;
    b->used_on.push_back(stream);
    if (!stream.is_default()) {
      try {
        device.hold_stream(stream);
      } catch (...) {
        b->used_on.pop_back();
        throw;
      }
    }
    pool.streams_recorded = true;
    if (!streams_ever_recorded_.load(std::memory_order_relaxed)) {
      streams_ever_recorded_.store(true, std::memory_order_release);
    }
  }
  /// Ends note_used_on's holds of the block's used_on and clears it (pool
  /// locked): at its free, once the events are recorded, or when nothing
  /// will wait for them any more (a forced clear's tombstone, teardown). The
  /// last release of a stream its owner destroyed destroys it (no wait).
  void let_used_on_go(block* b) noexcept;
  /// A late free of a tombstone on `stream`: its memory goes back to the
  /// sub-pool, last used on `stream`.
  void remove_tombstone(block_pool& part, block* b, backend::stream_ref stream);
  /// Tells the free-wait observers (one relaxed load when none); pool locked.
  void note_free_wait(const free_wait_event& event) const noexcept {
    if (hooks.has_free_wait_observers()) [[unlikely]] hooks.notify_free_wait(event);
  }
  /// Traces a tombstone's removal by its late free (forced_clear.cpp).
  void note_tombstone_removed(std::uintptr_t address, backend::stream_ref stream);

  // ---- streams their owners destroyed (destroyed_streams.cpp)
  /// Lets go of the streams with pools here that their owners destroyed
  /// (device::stream_destroy_pending) once nothing of the allocator needs
  /// them: no private block remembers them, no live block's free will
  /// record on them (record_stream), their pools hold no live block or
  /// pending free and their work has run. Their pools are made vacant with the
  /// memory they cached, for the next new stream (pool_directory.h), and
  /// the hold on each ends, which destroys it. With `wait` (empty_cache) it
  /// waits for their pending frees and their work first, and throws the
  /// first error once every stream had its turn; without (an allocation off
  /// the cached pair, where host_waits_allowed) it skips a stream whose
  /// work still runs or whose pending frees are not done, and drops errors.
  /// A skipped stream is looked at again later (schedule_sweep_retry).
  /// Takes no lock held.
  void let_destroyed_streams_go(bool wait);
  /// Whether an allocation off the cached pair should sweep: a destroy was
  /// deferred since the last sweep, or a skipped stream's retry is due.
  [[nodiscard]] bool sweep_due() noexcept;
  /// After a sweep (sweep_mutex_ held): a retry after a growing number of
  /// allocations when it skipped a stream, none otherwise.
  void schedule_sweep_retry(bool skipped) noexcept;
  /// The streams record_stream noted on live blocks (their frees will
  /// record there), from the pools whose hint says they may have some.
  [[nodiscard]] std::vector<backend::stream_ref> streams_recorded_on_live_blocks();
  /// One pool of a destroyed stream: its awaiting frees sealed (and waited
  /// for), pending frees collected (waited for with `wait`). Returns whether
  /// it holds no live block or pending free now.
  bool quiesce_destroyed_streams_pool(block_pool& pool, bool wait);
  /// One pool of a destroyed stream holds nothing to quiesce: no live block,
  /// no pending, awaiting or sealed free (at this look; the sweep's last
  /// query and its count of frees cover what comes after).
  bool idle_at_a_look(block_pool& pool);
  /// The deferred destroys (device::deferred_stream_destroys) the last sweep
  /// saw: an allocation off the cached pair sweeps when the device's count
  /// moved past it (one load).
  std::atomic<std::uint64_t> destroys_seen_{0};
  /// Set for good by the first stream record_stream notes on a block: until
  /// then no pool's blocks need a look (a stream per request pays none).
  std::atomic<bool> streams_ever_recorded_{false};
  /// Allocations off the cached pair until a skipped stream is looked at
  /// again (0: none skipped), and the next such wait.
  std::atomic<std::uint32_t> sweep_retry_in_{0};
  std::uint32_t sweep_retry_interval_ = 16;  // guarded by sweep_mutex_
  std::mutex sweep_mutex_;  ///< one sweep at a time; taken with no other allocator lock held

  /// In a fork() child: allocate and the calls that use one block further
  /// refuse; deallocate, record_stream and unmark_held_outside do nothing.
  const shoal::detail::fork_epoch epoch_;
  pool_directory directory_;
  held_streams held_streams_;  ///< streams private pools' blocks remember that no pool holds
  orphaned_tombstones orphans_;  ///< tombstones of destroyed private pools
  // Hands a region's orphaned tombstones over whole: held by
  // create_private_pool from reading the orphans in its region until the
  // new pool holds them (or, failing, gave them back), and by a free or
  // record_stream that found no block, while it looks again (and a free then
  // asks the orphans), and by a give-back that turns tombstones into orphans
  // again (try_lock under a pool lock: it never waits). So a late free lands
  // either on the orphan or on a tombstone, never between. Taken before
  // directory_mutex_.
  std::mutex region_handoff_mutex_;
  trace_ring trace_;
  event_pool events_;
  segment_source source_;
  std::atomic<std::int64_t> retries_{0}, ooms_{0};

  std::mutex observers_mutex_;
  std::vector<std::pair<std::uint64_t, std::function<void(const oom_report&)>>> observers_;  // guarded by observers_mutex_
  std::uint64_t last_observer_id_ = 0;                                                       // guarded by observers_mutex_

  // What destroyed private pools counted, by pool kind: stats() adds it, so
  // cumulative figures (allocated, freed) and peaks never go down when a
  // pool goes. Taken before directory_mutex_ (pool_directory.h): held by
  // stats() over its whole walk and by a destroy over the removal, so that a
  // pool's counters move here atomically for every reader.
  /// Moves a destroyed private pool part's counters into retired_ (retired_mutex_ held).
  void retire_counters(const block_pool& part);
  std::mutex retired_mutex_;
  std::array<pool_counters, pool_kinds> retired_{};       // guarded by retired_mutex_
  std::int64_t retired_region_reserved_peak_ = 0;        // guarded by retired_mutex_
};

template <class Fn>
bool allocator_core::run_on_block(std::uintptr_t address, Fn&& fn) const {
  // A thread's cache may be stale (the segment was released and its range
  // reused elsewhere): a pool that does not hold the block sends us on to
  // the directory, which is always right.
  auto found_in = [&](block_pool* pool) {
    if (pool == nullptr) return false;
    const biased_lock_guard lock(pool->lock);
    if (!pool->in_service) return false;
    block* b = pool->by_address.find(address);
    if (b == nullptr || (b->state != block_state::allocated && b->state != block_state::invalidated)) return false;
    fn(*pool, b);
    return true;
  };
  return found_in(directory_.cached_pool(address)) || found_in(directory_.directory_pool(address));
}

}  // namespace shoal::alloc::detail
