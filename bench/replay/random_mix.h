// The random-size mix: a synthetic trace for measuring fragmentation.
//
// A random walk of allocs and frees whose live bytes hover around a target:
// below it, 60% of events are allocs; at or above it, 40%. Sizes are
// log-uniform inside three classes (70% in [512 B, 1 MiB), 25% in
// [1, 32) MiB, 5% in [32, 256) MiB), never multiples of anything in
// particular, so rounding and splitting both matter. Frees pick a random
// live block, on the stream it was allocated on.
//
// Deterministic: the same options give the same trace on every platform
// (integer arithmetic only, a fixed generator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>

#include "bench/replay/trace.h"

namespace shoal::bench {

struct mix_options {
  std::size_t events = 10000;
  std::uint64_t seed = 1;
  /// Allocations are spread evenly at random over streams 0..streams-1.
  std::uint32_t streams = 1;
  std::uint64_t live_target_bytes = std::uint64_t{1} << 30;
};

/// A trace of exactly options.events events; its notes say how it was made.
/// Throws shoal::invalid_argument for 0 events, 0 streams or more than
/// max_trace_streams, or a live target of 0.
[[nodiscard]] trace generate_mix(const mix_options& options);
/// Writes generate_mix(options) as write_trace would, each event as it is
/// made: memory holds the live blocks only, however many events there are.
/// Stops at the first event `out` fails to take (its state says so). Throws
/// as generate_mix does, before writing anything.
void write_mix(std::ostream& out, const mix_options& options);

}  // namespace shoal::bench
