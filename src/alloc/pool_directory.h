// The pool directory: which pool serves a stream, a private-pool scope or a
// pointer. It owns every pool, and the segment directory that maps each
// segment's range to its pool.
//
// Invariants:
//   every stream with pools here is held on the device (hold_stream) until
//     its pools are made vacant (vacate_stream_pools, once its owner destroyed it
//     and they hold nothing but free memory whose uses have all run) or
//     release_stream_holds at teardown, so it is not destroyed, nor its
//     handle reused, while a pool may still synchronize it or a block
//     remember it;
//   a pool, once made, lives as long as the directory (a destroyed private
//     pool's sub-pools are emptied and kept in reusable_parts_ to serve a
//     later private pool), so a stale per-thread cache entry never points
//     at freed memory; an entry naming a sub-pool that serves another
//     region now is caught like any stale one (the caller checks the
//     pool), and a vacating makes every thread's last-pools entry stale at
//     once (pools_serial_ changes);
//   a pool in reusable_parts_ holds no segment, block or count and is out
//     of service (its block objects wait in its spare list);
//   vacant_pools_ holds the pools of streams let go, with the memory they
//     cached: in service, walked with the live pools (their segments stay
//     in the segment directory, their counts in the statistics), vacant
//     set and stream the default, and no allocated, pending or parked
//     block — every free block's last use has run, so the next stream
//     that needs pools takes them, cache and all, with no device call;
//   segments_by_base_ = { s.base -> (s.size, s.pool) : s a segment of a
//     live pool }, so a pointer inside a live segment finds its pool.
//
// Ordering rule: a segment leaves the directory before its memory goes back
// to the device, and enters it after the device gave it out. The device may
// hand the same address to another pool as soon as it is freed; a removal
// after that would delete the new segment's entry, and its live blocks would
// be lost (segment_source::release_segment keeps the rule).
//
// Lock order of the whole allocator, stated here once:
//   allocator_core::sweep_mutex_ (letting destroyed streams go; taken with
//   no other lock held, and held over the sweep's device calls)
//   -> allocator_core::retired_mutex_ (stats and private pool destroys only)
//   or allocator_core::region_handoff_mutex_ (a private pool's creation over
//   a region, a free or record_stream that found no block), never both,
//   -> directory_mutex_ -> one pool's lock -> the leaf locks: segments_mutex_,
//   the event pool's, the trace ring's, the hooks' (release observers), the
//   orphaned tombstones', the segment source's detached count, the held
//   streams' (under which only the device's hold bookkeeping runs; the
//   directory holds a stream with no lock of its own held). Leaf locks are
//   not held together, except under segments_mutex_ by the invariant checker
//   (the orphaned tombstones', the detached count's; nothing takes them the
//   other way round). The hooks' lock is a leaf only for its writers (add,
//   remove): a miss or forced-clear hook runs under it held shared and may
//   free blocks (a pool's lock), while a pool lock's holder takes it shared to
//   notify observers. Both are shared holds of a std::shared_mutex, which
//   glibc's rwlock serves to readers while a writer waits (its default,
//   reader-preferring kind), so neither waits for the other; a lock that made
//   readers queue behind a waiting writer would deadlock here.
// Two pool locks are never held at once, except by with_every_pool_locked
// (the invariant checker), which takes them all in one fixed order while
// it holds directory_mutex_ shared, by remove_private_pool, which takes
// one private pool's sub-pools in their order while it holds
// directory_mutex_ exclusively, by vacate_stream_pools, which takes a stream's
// two pools with std::scoped_lock (it waits for one holding neither) while
// it holds directory_mutex_ exclusively, and by a growing pool that try_locks its
// sibling (segment_source::give_back_from_sibling) and never waits for it
// (nor for the region hand-off lock, which a give-back of tombstones
// try_locks under a pool lock), and by a look at every pool
// (look_at_each_pool: statistics), holding no other pool lock, which takes
// the free ones with try_lock, waits only for an owner inside by the fast
// way (as anyone taking that lock would) and lets each go as soon as its
// owner is out, then takes a busy one alone, holding none of the others;
// as nobody else waits for a pool lock while holding another, this cannot
// deadlock. Cache-miss hooks run with no
// allocator lock held. Device calls may run under a pool lock (like
// cudaMalloc under PyTorch's) and the region hand-off lock above it, never
// under the others.
//
// Thread-safety: every member may be called from any thread at once, except
// for_each_pool_ever (teardown only).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "alloc/block_pool.h"
#include "shoal/alloc/allocator_types.h"
#include "shoal/backend/device.h"

namespace shoal::alloc::detail {

struct stream_pools {
  block_pool small;
  block_pool large;
  /// Set once a private pool's block was handed out on the stream: such a
  /// block remembers it (as its stream, then among its last streams once
  /// freed), so the stream stays held until teardown (its pools never
  /// are never made vacant). Written with no lock; read by vacate_stream_pools under the
  /// directory's lock (a race needs an allocation on a stream its owner
  /// destroyed).
  std::atomic<bool> private_blocks_remember{false};
  block_pool& of(pool_kind kind) { return kind == pool_kind::small ? small : large; }
};

struct private_pool {
  std::vector<std::unique_ptr<block_pool>> parts;
  block_pool* part(const std::string& name);
};

/// The segment directory's entries: base -> (size, pool).
using segment_map = std::map<std::uintptr_t, std::pair<std::size_t, block_pool*>>;

/// A private_pool_scope's target: the sub-pool, and its service generation
/// when the scope began (block_pool::service_generation).
struct pool_direction {
  block_pool* part = nullptr;
  std::uint64_t generation = 0;
};

// This thread's caches of the directory's answers, read on every allocation
// and free: defined here (constant-initialized, so no per-access guard) so
// that the lookups inline. Entries name their directory by serial. Hidden:
// two copies of the library in one process (each with its own serials)
// never share them.
namespace thread_cache __attribute__((visibility("hidden"))) {
/// How many private_pool_scope directions the thread has (any directory):
/// 0 for almost every thread, so "no scope" costs one load.
inline thread_local std::size_t direction_count = 0;
/// The last stream pools this thread used.
struct last_pools_entry {
  std::uint64_t directory = 0;
  void* stream = nullptr;
  stream_pools* pools = nullptr;
};
inline thread_local last_pools_entry last_pools;
/// Segments whose pools this thread freed into lately: [low, high) -> pool.
struct range_cache {
  struct entry {
    std::uint64_t directory = 0;
    std::uintptr_t low = 0, high = 0;
    block_pool* pool = nullptr;
  };
  std::array<entry, 4> entries;
  std::size_t next = 0;
};
inline thread_local range_cache recent_segments;
}  // namespace thread_cache

class pool_directory {
 public:
  explicit pool_directory(backend::device& device);
  pool_directory(const pool_directory&) = delete;
  pool_directory& operator=(const pool_directory&) = delete;

  // ---- pools
  /// The stream's pools when they are the ones this thread used last, else
  /// nullptr (pool_for finds any).
  [[nodiscard]] stream_pools* cached_pools(backend::stream_ref stream) const noexcept {
    const auto& last = thread_cache::last_pools;
    return last.directory == pools_serial() && last.stream == stream.native ? last.pools : nullptr;
  }
  /// The stream's pools, made on first use (and the stream held).
  [[nodiscard]] stream_pools& pools_of(backend::stream_ref stream) {
    const auto& last = thread_cache::last_pools;
    if (last.directory == pools_serial() && last.stream == stream.native) [[likely]] return *last.pools;
    return pools_of_uncached(stream);
  }
  /// The stream's pool of `kind`, made on first use (and the stream held).
  [[nodiscard]] block_pool& pool_for(backend::stream_ref stream, pool_kind kind) { return pools_of(stream).of(kind); }
  /// Holds the stream until teardown, by its pools (made when it has none,
  /// then never made vacant): for a private pool's block handed out on it, which
  /// remembers it.
  void hold_stream_for_private_blocks(backend::stream_ref stream) {
    std::atomic<bool>& mark = pools_of(stream).private_blocks_remember;
    if (!mark.load(std::memory_order_relaxed)) [[unlikely]] mark.store(true, std::memory_order_relaxed);
  }
  /// Ends the holds on every stream with pools here (the streams destroyed
  /// meanwhile go now). Teardown only, after the pools' last device calls;
  /// errors are dropped (the device may be gone).
  void release_stream_holds() noexcept;

  // ---- streams their owners destroyed
  /// The streams with pools here that their owners destroyed meanwhile
  /// (device::stream_destroy_pending).
  [[nodiscard]] std::vector<backend::stream_ref> streams_destroyed_by_owner() const;
  /// The stream's pools, or nullptr when it has none.
  [[nodiscard]] stream_pools* find_stream_pools(backend::stream_ref stream) const;
  /// Makes a stream's pools vacant, with the directory's lock and both pools'
  /// held: ready(pool) runs for each first (it may settle the quick list)
  /// and must say that nothing of the pool is in use any more; the pools
  /// must also hold no allocated, pending or parked block, and no private
  /// block may remember the stream (private_blocks_remember). Else nothing
  /// changes and this returns false. Vacant, they leave the stream's entry
  /// for vacant_pools_ with their cached memory (see the invariants), and
  /// every thread's last-pools entry goes stale. Returns true: the caller
  /// ends the stream's hold then (end_vacated_stream_hold), with no
  /// allocator lock held.
  bool vacate_stream_pools(backend::stream_ref stream, const std::function<bool(block_pool&)>& ready);
  /// Ends the hold the directory had on a stream whose pools were made vacant,
  /// which destroys it; an error of that destroy is dropped (the hold is
  /// gone either way: only an adopted stream's destroy fails there).
  void end_vacated_stream_hold(backend::stream_ref stream) noexcept;
  /// Runs fn(pool) for every live pool (vacant ones too), one at a time,
  /// with no lock held.
  template <class Fn>
  void for_each_pool(Fn&& fn) const;
  /// Runs fn(pool) for every stream pool, vacant ones too (not private
  /// sub-pools), one at a time, with no lock held.
  template <class Fn>
  void for_each_stream_pool(Fn&& fn) const;
  /// Runs fn(pool) holding that pool's lock, for every live pool (vacant
  /// ones too; private sub-pools when private_too), through
  /// biased_lock::look_at_each: no pool's bias goes to the reader, and one
  /// heavy fence serves them all. For readers of counters: fn is noexcept
  /// and takes no lock of the allocator; the caller holds no pool lock.
  template <class Fn>
  void look_at_each_pool(bool private_too, Fn&& fn) const;
  /// look_at_each_pool for an fn that may throw (a copy that may run out of
  /// memory): the first exception skips the pools after it and is thrown
  /// once every pool is let go.
  template <class Fn>
  void look_at_each_pool_or_throw(bool private_too, Fn&& fn) const;
  /// Runs fn(pool) for every pool ever made, emptied sub-pools of destroyed
  /// private pools too.
  /// Teardown only: no other call may run.
  template <class Fn>
  void for_each_pool_ever(Fn&& fn);
  /// Runs fn(pools, segments) with every live pool's lock held, and the
  /// segment directory's, so that nothing in the allocator changes.
  template <class Fn>
  void with_every_pool_locked(Fn&& fn) const;
  /// Runs fn(pools, vacant) with the directory's lock held: the stream
  /// pools that serve a stream, and the vacant ones (the invariant checker,
  /// and its test hook; no pool lock is held).
  template <class Fn>
  void with_stream_pools_listed(Fn&& fn) const {
    std::shared_lock directory_lock(directory_mutex_);
    std::vector<stream_pools*> serving, vacant;
    for (const auto& [native, p] : stream_pools_) serving.push_back(p.get());
    for (const auto& p : vacant_pools_) vacant.push_back(p.get());
    fn(static_cast<const std::vector<stream_pools*>&>(serving), static_cast<const std::vector<stream_pools*>&>(vacant));
  }

  // ---- private pools
  /// A sub-pool to build a new private pool from: one a destroyed private
  /// pool left, when there is one (its memory is no page new to the
  /// process, so making it costs no page faults), else a new one. Either is
  /// out of service until add_private_pool.
  [[nodiscard]] std::unique_ptr<block_pool> new_private_part();
  /// Adds a private pool and registers its segments, together; returns its
  /// id. On a throw nothing is added and `pool` stays the caller's.
  private_pool_id add_private_pool(std::unique_ptr<private_pool>& pool);
  /// Takes back the sub-pools of a private pool that was never added (its
  /// making failed): emptied, kept for reuse.
  void discard_private_pool(std::unique_ptr<private_pool> pool) noexcept;
  /// The named sub-pool; throws invalid_argument when there is none.
  [[nodiscard]] block_pool& private_part(private_pool_id id, const std::string& part) const;
  /// Every sub-pool of a private pool; invalid_argument when there is none.
  [[nodiscard]] std::vector<block_pool*> private_parts(private_pool_id id) const;
  /// Removes a private pool, with every sub-pool's lock held at once:
  /// ready(parts) checks them all first — throwing, or returning false
  /// (then this returns false), changes nothing — then take(part), which
  /// must not throw and must leave every block free or a tombstone, runs
  /// for each; then, all locks still held, its segments are unregistered
  /// and its sub-pools emptied for reuse. Returns true.
  bool remove_private_pool(private_pool_id id, const std::function<bool(const std::vector<block_pool*>&)>& ready,
                           const std::function<void(block_pool&)>& take);
  /// The named sub-pool and its service generation, for a
  /// private_pool_scope; throws invalid_argument as private_part does.
  [[nodiscard]] pool_direction direction_to(private_pool_id id, const std::string& part) const;
  /// Where this thread's allocations are directed (part nullptr: nowhere).
  [[nodiscard]] pool_direction directed_pool() const noexcept {
    if (thread_cache::direction_count == 0) [[likely]] return {};
    return scoped_direction();
  }
  /// Directs this thread's allocations to `to`; returns the previous one.
  pool_direction direct_to(pool_direction to) noexcept;

  // ---- finding a pointer's pool
  /// The pool of a segment this thread freed into lately that covers
  /// `address`, or nullptr. May be stale: the caller checks the pool.
  [[nodiscard]] block_pool* cached_pool(std::uintptr_t address) const noexcept {
    for (const auto& e : thread_cache::recent_segments.entries) {
      if (e.directory == serial_ && address - e.low < e.high - e.low) return e.pool;
    }
    return nullptr;
  }
  /// The pool whose segment covers `address`, or nullptr (and remembers it
  /// for this thread).
  [[nodiscard]] block_pool* directory_pool(std::uintptr_t address) const;
  void register_segment(const segment& s);
  void unregister_segment(const segment& s);
  /// unregister_segment, keeping the entry to put back (no allocation, so
  /// putting it back cannot fail).
  [[nodiscard]] segment_map::node_type take_segment_entry(const segment& s);
  void put_back_segment_entry(segment_map::node_type entry) noexcept;
  /// The registered segment that overlaps [base, base + size), or end().
  /// Under segments_mutex_.
  [[nodiscard]] segment_map::const_iterator overlapping_locked(std::uintptr_t base, std::size_t size) const;
  /// The next number in the order this allocator takes its segments in
  /// (segment::sequence): 1 for the first, and on.
  [[nodiscard]] std::uint64_t next_segment_sequence() noexcept {
    return segments_taken_.fetch_add(1, std::memory_order_relaxed) + 1;
  }

 private:
  stream_pools& pools_of_uncached(backend::stream_ref stream);
  [[nodiscard]] std::uint64_t pools_serial() const noexcept { return pools_serial_.load(std::memory_order_relaxed); }
  /// Points both pools at `stream` (the default one: vacant), under their
  /// locks: a walk of the pools listed before may be looking at them.
  static void serve(stream_pools& pools, backend::stream_ref stream, bool vacant) noexcept;
  [[nodiscard]] pool_direction scoped_direction() const noexcept;
  void keep_for_reuse(std::unique_ptr<block_pool> part) noexcept;  // directory_mutex_ held
  [[nodiscard]] block_pool& find_private_part(private_pool_id id, const std::string& part) const;  // directory_mutex_ held
  /// Every stream pool's two pools, and with `private_too` every private
  /// pool's sub-pools: listed under the directory's lock, used after it.
  [[nodiscard]] std::vector<block_pool*> live_pools(bool private_too) const;

  backend::device& device_;
  const std::uint64_t serial_;  // tells this directory's thread-local cache entries apart
  // Tells its last-pools entries apart: serial_ at first, a new serial (from
  // the same count, so never another directory's) each time pools are made vacant.
  std::atomic<std::uint64_t> pools_serial_;
  std::atomic<std::uint64_t> segments_taken_{0};

  mutable std::shared_mutex segments_mutex_;
  segment_map segments_by_base_;  // guarded by segments_mutex_

  mutable std::shared_mutex directory_mutex_;
  std::unordered_map<void*, std::unique_ptr<stream_pools>> stream_pools_;  // guarded by directory_mutex_
  std::map<std::uint64_t, std::unique_ptr<private_pool>> private_pools_;   // guarded by directory_mutex_
  std::vector<std::unique_ptr<block_pool>> reusable_parts_;                // guarded by directory_mutex_
  std::vector<std::unique_ptr<stream_pools>> vacant_pools_;                // guarded by directory_mutex_
  std::uint64_t next_private_id_ = 1;                                     // guarded by directory_mutex_
};

inline std::vector<block_pool*> pool_directory::live_pools(bool private_too) const {
  std::vector<block_pool*> pools;
  std::shared_lock lock(directory_mutex_);
  for (auto& [stream, p] : stream_pools_) {
    pools.push_back(&p->small);
    pools.push_back(&p->large);
  }
  for (auto& p : vacant_pools_) {
    pools.push_back(&p->small);
    pools.push_back(&p->large);
  }
  if (private_too) {
    for (auto& [id, p] : private_pools_) {
      for (auto& part : p->parts) pools.push_back(part.get());
    }
  }
  return pools;
}

template <class Fn>
void pool_directory::for_each_pool(Fn&& fn) const {
  for (block_pool* p : live_pools(true)) fn(*p);
}

template <class Fn>
void pool_directory::for_each_stream_pool(Fn&& fn) const {
  for (block_pool* p : live_pools(false)) fn(*p);
}

template <class Fn>
void pool_directory::look_at_each_pool(bool private_too, Fn&& fn) const {
  static_assert(std::is_nothrow_invocable_v<Fn&, block_pool&>, "a look runs holding pool locks: it must not throw");
  const std::vector<block_pool*> pools = live_pools(private_too);
  std::vector<biased_lock*> locks;
  locks.reserve(pools.size());
  for (block_pool* p : pools) locks.push_back(&p->lock);
  auto look = [&](std::size_t i) noexcept { fn(*pools[i]); };
  biased_lock::look_at_each(locks, look);
}

template <class Fn>
void pool_directory::look_at_each_pool_or_throw(bool private_too, Fn&& fn) const {
  std::exception_ptr first;
  look_at_each_pool(private_too, [&](block_pool& p) noexcept {
    if (first) return;
    try {
      fn(p);
    } catch (...) {
      first = std::current_exception();
    }
  });
  if (first) std::rethrow_exception(first);
}

template <class Fn>
void pool_directory::for_each_pool_ever(Fn&& fn) {
  for (auto& [stream, p] : stream_pools_) {
    fn(p->small);
    fn(p->large);
  }
  for (auto& p : vacant_pools_) {
    fn(p->small);
    fn(p->large);
  }
  for (auto& [id, p] : private_pools_) {
    for (auto& part : p->parts) fn(*part);
  }
  for (auto& part : reusable_parts_) fn(*part);
}

template <class Fn>
void pool_directory::with_every_pool_locked(Fn&& fn) const {
  std::shared_lock directory_lock(directory_mutex_);
  std::vector<block_pool*> pools;
  for (auto& [stream, p] : stream_pools_) {
    pools.push_back(&p->small);
    pools.push_back(&p->large);
  }
  for (auto& p : vacant_pools_) {
    pools.push_back(&p->small);
    pools.push_back(&p->large);
  }
  for (auto& [id, p] : private_pools_) {
    for (auto& part : p->parts) pools.push_back(part.get());
  }
  std::vector<std::unique_lock<biased_lock>> locks;
  locks.reserve(pools.size());
  for (block_pool* p : pools) locks.emplace_back(p->lock);
  std::shared_lock segments_lock(segments_mutex_);
  fn(static_cast<const std::vector<block_pool*>&>(pools), static_cast<const segment_map&>(segments_by_base_));
}

}  // namespace shoal::alloc::detail
