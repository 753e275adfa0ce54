// Settings of the caching allocator, in code or from SHOAL_ALLOC_CONF.
//
// SHOAL_ALLOC_CONF is a comma-separated list of key:value pairs, e.g.
//   SHOAL_ALLOC_CONF="max_split_size_mb:256,expandable_segments:true,debug:false"
// Keys (sizes in MiB unless the key says otherwise):
//   max_split_size_mb          blocks at least this large are never split, more than 20 (default:
//                              none); private pools and expandable segments split them all the same
//   max_non_split_rounding_mb  how much larger than asked an unsplittable block may be (default 20)
//   roundup_power2_divisions   N, or [size_mb:N,size_mb:N,>:N]: round requests up to
//                              one of N steps inside their power-of-two interval
//   expandable_segments        true|false: one growable range per stream and pool. On a
//                              device without growable ranges (backend::device::growable();
//                              CUDA without virtual memory management, as on some
//                              virtualized, MIG or WSL setups) plain segments serve
//                              instead, not an error: the allocator's config() then says
//                              false and stats().expandable_segments_fallback true
//   debug                      true|false: poison reusable blocks, check hand-outs
//   cross_stream_safety        true|false: false turns the free-stream hold off (unsafe)
//   release_idle_before_grow   true|false: growth that would raise the peak of reserved
//                              memory first gives back idle memory that did not fit
//                              (wholly free segments, free whole chunks of growable ones):
//                              the pool's own, then its stream's other size class's, until
//                              the growth stays at the peak (default true)
//   memory_limit_mb            fail allocations past this many reserved MiB
//   memory_fraction            fail allocations past this fraction of the device (0..1]
//   trace_entries              keep the last N trace records (0: no trace; at most
//                              allocator_config::max_trace_entries, 16 Mi)
//   memory                     device|pinned_host: where segments come from (default device;
//                              see allocator_memory)
// An unknown key or a bad value throws shoal::invalid_argument naming it.
//
// A value type: not synchronized; copy it freely.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::alloc {

/// Where an allocator's segments come from.
enum class allocator_memory : std::uint8_t {
  /// The device's own memory (allocate_segment, or growable ranges).
  device,
  /// Pinned host memory (device::allocate_pinned_host): a pinned host
  /// caching allocator for staging copies. The CPU reads and writes these
  /// blocks outside stream order, so every free — on the block's own stream
  /// too — waits on the host for the events of the streams it names (and
  /// record_stream's) before the block is handed out again; there is no
  /// GPU-side early reuse. Growable segments and memory_fraction (a share of
  /// the device) do not apply: either gives invalid_argument; memory_limit
  /// bounds the pinned footprint.
  pinned_host,
};

struct allocator_config {
  static constexpr std::size_t no_limit = ~std::size_t{0};
  /// The most trace records an allocator keeps (trace_entries).
  static constexpr std::size_t max_trace_entries = std::size_t{1} << 24;
  /// The least memory any allocation reserves (a small-pool segment, a
  /// growable chunk): a memory_limit below it is refused (invalid_argument).
  static constexpr std::size_t smallest_reservation = std::size_t{2} << 20;

  /// Blocks of this size or more are never split (PyTorch: max_split_size).
  std::size_t max_split_size = no_limit;
  /// An unsplittable block is used for a request only if it is at most this
  /// much larger than the request.
  std::size_t max_non_split_rounding = std::size_t{20} << 20;
  /// Divisions per power-of-two interval, indexed by log2 of the interval's
  /// lower bound (0 or 1: plain 512-byte rounding).
  std::array<std::uint32_t, 64> roundup_power2_divisions{};
  /// One growable range per stream and pool, in place of plain segments;
  /// falls back to plain segments where the device has none (see above).
  bool expandable_segments = false;
  bool debug = false;
  bool cross_stream_safety = true;
  /// Before a pool grows past the peak of reserved memory, it gives back
  /// idle memory that did not fit the request: its wholly free segments
  /// until the growth stays at the peak, or every free whole chunk of its
  /// growable segment; then, if its lock is free at once, enough of its
  /// stream's other size class's. Growth below the peak keeps them for
  /// reuse: giving them back would cost device calls and lower no peak.
  /// Costs a wait for the pool's stream and device frees, at growth past
  /// the peak only.
  bool release_idle_before_grow = true;
  /// Reserved bytes past which allocation fails (no_limit: none; at least
  /// smallest_reservation). A request
  /// that fits under it is served even where its pool's standard segment
  /// (20 MiB for blocks under 10 MiB) would pass it: it then gets a segment
  /// of its own size, rounded to 2 MiB (as when the device refuses one) —
  /// only after reusing pending frees and giving every pool's cached
  /// memory back left no room for the standard segment.
  std::size_t memory_limit = no_limit;
  /// Fraction of the device's total memory past which allocation fails
  /// (0: none). The smaller of this and memory_limit applies.
  double memory_fraction = 0.0;
  /// Trace records kept in a ring (0: tracing off); the ring is taken when
  /// the allocator is made, so at most max_trace_entries (invalid_argument).
  std::size_t trace_entries = 0;
  allocator_memory memory = allocator_memory::device;

  /// Parses "key:value,key:value" on top of the defaults.
  [[nodiscard]] static allocator_config parse(std::string_view text);
  /// parse(getenv("SHOAL_ALLOC_CONF")), or the defaults when unset.
  [[nodiscard]] static allocator_config from_environment();
  /// The settings as SHOAL_ALLOC_CONF text that parse() reads back.
  [[nodiscard]] std::string to_string() const;
};

}  // namespace shoal::alloc

#pragma GCC visibility pop
