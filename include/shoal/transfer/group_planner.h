// Choosing the groups of a grouped load: from a per-layer profile (bytes to
// copy, compute time) and the measured cost of copying a group, the grouping
// that minimizes the time from the start of loading to the completion of the
// last layer.
//
// Model (docs/architecture.md, "Grouped loading"): groups are runs of
// consecutive layers, in execution order. The copy stream copies them one
// after another; group g is ready at
//     F(g) = F(g-1) + per_group_seconds + bytes(g) / bytes_per_second.
// The compute stream runs the layers in order, and runs group g's layers once
// group g is ready and the previous layers are done:
//     E(g) = max(E(g-1), F(g)) + compute(g).
// The first layer starts at F(1); the model is done at E(last).
//
// plan_groups finds the exact optimum by dynamic programming over (layers
// covered, groups used): F depends only on the layers covered and the number
// of groups, and E is monotone in the previous E, so the best plan for a
// prefix with a given number of groups extends to the best overall. O(n^3)
// time, O(n^2) memory for n layers; past max_planned_layers, consecutive
// layers are planned in fixed runs (the grouping is optimal at that
// granularity, and never worse than one group per layer or one group).
//
// Thread-safety: pure functions, except measure_copy_cost, which uses the
// device and stream it is given (nothing else may use that stream meanwhile).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "shoal/backend/device.h"

// The public API: exported from a shared libshoal (the library's own code is hidden).
#pragma GCC visibility push(default)

namespace shoal::transfer {

struct layer_cost {
  std::size_t bytes = 0;       ///< parameters (and buffers) to copy for the layer
  double compute_seconds = 0;  ///< the layer's run time on the compute stream (>= 0)
};

struct copy_cost {
  double per_group_seconds = 0;  ///< fixed cost of one group: enqueueing, the event, the wait (>= 0)
  double bytes_per_second = 0;   ///< host→device bandwidth (> 0)
};

struct group_plan {
  /// Exclusive end (a layer index) of each group, increasing; the last is the
  /// layer count.
  std::vector<std::size_t> group_ends;
  double first_layer_start = 0;  ///< seconds from the start of loading, as the model predicts
  double last_layer_end = 0;
};

inline constexpr std::size_t max_planned_layers = 1024;

/// The grouping with the earliest completion of the last layer (fewest groups
/// on a tie). invalid_argument for no layers or a cost out of range.
[[nodiscard]] group_plan plan_groups(std::span<const layer_cost> layers, copy_cost cost);

/// The model's prediction for a given grouping (group_ends as in group_plan).
/// invalid_argument when group_ends is not increasing or does not end at the
/// layer count.
[[nodiscard]] group_plan evaluate_grouping(std::span<const layer_cost> layers, copy_cost cost,
                                           std::vector<std::size_t> group_ends);

/// One group per layer, and one group for the whole model: the two
/// groupings the optimum is compared against.
[[nodiscard]] group_plan one_group_per_layer(std::span<const layer_cost> layers, copy_cost cost);
[[nodiscard]] group_plan one_group_for_all(std::span<const layer_cost> layers, copy_cost cost);

/// Measures the copy cost on `device`: groups of one small copy each, back to
/// back with an event after each, for the per-group cost; large copies from
/// page-locked memory for the bandwidth. Uses `stream` (idle, nobody else's)
/// and memory of its own, freed before it returns.
[[nodiscard]] copy_cost measure_copy_cost(backend::device& device, backend::stream_ref stream);

}  // namespace shoal::transfer

#pragma GCC visibility pop
