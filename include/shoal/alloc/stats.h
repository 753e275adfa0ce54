// What the caching allocator reports about itself: counters, a snapshot of
// every segment and block, and the trace ring. All plain values, taken at
// one moment; exporting them to JSON is for tools and humans.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shoal/alloc/allocator_types.h"
#include "shoal/backend/types.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::alloc {

/// One counter: its value now, its high-water mark, and how much was added
/// and removed in total. Invariant: current = allocated - freed <= peak.
struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;
};

enum class pool_kind : std::uint8_t { small = 0, large = 1 };
inline constexpr std::size_t pool_kinds = 2;

/// A stat per pool and in total ("aggregate").
struct stat_by_pool {
  stat aggregate;
  std::array<stat, pool_kinds> pool;
};

/// The device calls growable segments (expandable_segments) made, one
/// driver call each on CUDA: what replays spend their time on there.
/// creates and releases count chunks taken and given back; maps, unmaps and
/// access grants count calls, a failed one included (it cost the driver's
/// time). access_grants is one per growth's mapping, which covers all its
/// chunks; the driver's time for one grows with the chunks
/// (docs/benchmarks.md). Plain segments are device_allocations and
/// device_frees alone.
struct vmm_call_counts {
  std::int64_t creates = 0;        ///< physical chunks created (cuMemCreate)
  std::int64_t releases = 0;       ///< physical chunks released (cuMemRelease)
  std::int64_t maps = 0;           ///< chunks mapped into a reserved range (cuMemMap)
  std::int64_t unmaps = 0;         ///< chunks unmapped (cuMemUnmap)
  std::int64_t access_grants = 0;  ///< access set over newly mapped memory (cuMemSetAccess)

  [[nodiscard]] std::int64_t total() const noexcept { return creates + releases + maps + unmaps + access_grants; }
};

struct allocator_stats {
  stat_by_pool allocations;         ///< blocks handed out
  stat_by_pool segments;            ///< device allocations held
  stat_by_pool active;              ///< blocks allocated or waiting for a stream
  stat_by_pool inactive_split;      ///< free blocks that are part of a split segment (free neighbours counted merged)
  stat_by_pool allocated_bytes;     ///< bytes of blocks handed out (rounded)
  stat_by_pool reserved_bytes;      ///< bytes of device memory held (aggregate peak: exact, not a sum of peaks)
  stat_by_pool active_bytes;        ///< bytes of active blocks
  stat_by_pool inactive_split_bytes;
  stat_by_pool requested_bytes;     ///< bytes the callers asked for (unrounded) of active blocks, as PyTorch counts them
  /// Tombstones a forced clear left (block_state::invalidated): blocks taken
  /// from their owners whose late frees are still owed, in the private pool,
  /// or in a stream pool's segment the device placed at such an address
  /// after the pool was destroyed (giving such a segment back leaves them
  /// owed by address only, counted nowhere). Counted in neither allocations
  /// nor active.
  stat_by_pool invalidated;
  stat_by_pool invalidated_bytes;
  std::int64_t retries = 0;         ///< allocations that freed cache and tried again
  std::int64_t ooms = 0;            ///< out_of_memory errors thrown
  std::int64_t device_allocations = 0;  ///< segments (or chunks) taken from the device
  std::int64_t device_frees = 0;        ///< segments (or chunks) returned to it
  /// The growable segments' share of the device calls, call by call
  /// (creates and releases are also in device_allocations and device_frees).
  vmm_call_counts vmm_calls;
  /// expandable_segments was asked for, but the device has no growable
  /// ranges (backend::device::growable()): plain segments serve instead, and
  /// config() says expandable_segments:false. Not a counter: no reset
  /// changes it.
  bool expandable_segments_fallback = false;

  [[nodiscard]] std::string to_json() const;
};

enum class block_state : std::uint8_t {
  allocated,       ///< handed out
  pending_free,    ///< freed, waiting for another stream to pass it
  free,            ///< reusable
  /// A tombstone: a block a forced clear took from its owner, cut to 512
  /// bytes at its address; its owner's late free removes it.
  invalidated,
};

struct block_snapshot {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  ///< 0 unless allocated or pending_free
  block_state state = block_state::free;
};

struct segment_snapshot {
  std::uintptr_t address = 0;
  std::size_t size = 0;           ///< reserved address range
  std::size_t mapped_bytes = 0;   ///< backed by device memory (= size unless expandable)
  pool_kind pool = pool_kind::small;
  backend::stream_ref stream;     ///< the stream its blocks are handed out on (none while vacant)
  /// Cached for a stream the allocator let go (its owner destroyed it):
  /// the next new stream takes it over; `stream` shows the default one
  /// meanwhile, whose allocations do not use it.
  bool vacant = false;
  bool expandable = false;
  bool external = false;          ///< memory handed in (a private pool), never freed by the allocator
  std::string private_pool;       ///< its name, for external memory
  private_pool_id owner;          ///< the private pool it belongs to (value 0: none)
  /// The order this allocator took its segments in: unique among its
  /// segments, never 0, kept for the segment's life and not used again
  /// after it is given back (numbers may be skipped). A segment taken later
  /// into the same pool has a larger number; across pools growing on
  /// different threads, it is the order they drew their numbers in.
  std::uint64_t sequence = 0;
  std::vector<block_snapshot> blocks;
};

struct snapshot {
  std::vector<segment_snapshot> segments;
  [[nodiscard]] std::string to_json() const;
};

enum class trace_action : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,
  segment_unmap,
  oom,
};

struct trace_entry {
  trace_action action = trace_action::alloc;
  std::uintptr_t address = 0;
  std::size_t size = 0;
  backend::stream_ref stream;
  std::uint64_t time_ns = 0;  ///< steady clock
};

[[nodiscard]] std::string to_json(const std::vector<trace_entry>& trace);

/// A change of the device memory an allocator holds, as its segment
/// observers are told of it (caching_allocator::add_segment_observer):
/// segment_alloc / segment_free, a plain segment taken from the device or
/// given back whole; segment_map / segment_unmap, a stretch [address,
/// address + size) of a growable segment backed by memory or unbacked.
struct segment_event {
  trace_action action = trace_action::segment_alloc;
  std::uintptr_t address = 0;
  std::size_t size = 0;
  backend::stream_ref stream;  ///< its pool's stream (none: a destroyed growing private pool's segment)
  private_pool_id pool;        ///< the growing private pool it belongs to, destroyed too (0: the stream pools)
};

/// A free that waits for streams (a pending free: the block was freed on
/// another stream than its own, or record_stream named one), as free-wait
/// observers are told of it (caching_allocator::add_free_wait_observer):
/// `held` when the free is called and the block starts to wait, `completed`
/// when every stream it waits for has passed its last use and the block is
/// free again (early under memory pressure, or at a forced clear, which
/// waited for the device). A free that waits for nothing is told neither.
struct free_wait_event {
  enum class action : std::uint8_t { held, completed };
  action what = action::held;
  std::uintptr_t address = 0;
  std::size_t size = 0;
  backend::stream_ref stream;  ///< the block's own stream
};

}  // namespace shoal::alloc

#pragma GCC visibility pop
