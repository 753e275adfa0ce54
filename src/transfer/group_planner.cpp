#include "shoal/transfer/group_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "shoal/core/error.h"

namespace shoal::transfer {

namespace {

void validate(std::span<const layer_cost> layers, copy_cost cost) {
  if (layers.empty()) throw invalid_argument("plan_groups: no layers");
  if (!(cost.bytes_per_second > 0) || !std::isfinite(cost.bytes_per_second) || !(cost.per_group_seconds >= 0) ||
      !std::isfinite(cost.per_group_seconds)) {
    throw invalid_argument(
        "plan_groups: the copy cost needs bytes_per_second "
        "> 0 and per_group_seconds >= 0");
  }
  for (const layer_cost& l : layers) {
    if (!(l.compute_seconds >= 0) || !std::isfinite(l.compute_seconds)) {
      throw invalid_argument("plan_groups: a layer's compute_seconds must be finite and >= 0");
    }
  }
}

/// A layer as the optimum sees it: bytes as a double, so that merged layers
/// add up without wrapping (a hostile profile's sizes near 2^64 would sum
/// to a small number and make a layer that costs the most look free).
struct planned_layer {
  double bytes = 0;
  double compute_seconds = 0;
};

/// Runs of `unit` consecutive layers merged into one, so that at most
/// max_planned_layers remain (unit 1: the layers as they are).
std::vector<planned_layer> merged_runs(std::span<const layer_cost> layers, std::size_t unit) {
  std::vector<planned_layer> out;
  out.reserve((layers.size() + unit - 1) / unit);
  for (std::size_t i = 0; i < layers.size(); i += unit) {
    planned_layer merged;
    for (std::size_t j = i; j < std::min(layers.size(), i + unit); ++j) {
      merged.bytes += static_cast<double>(layers[j].bytes);
      merged.compute_seconds += layers[j].compute_seconds;
    }
    out.push_back(merged);
  }
  return out;
}

/// The exact optimum over groupings of `layers` (at most max_planned_layers).
std::vector<std::size_t> optimal_ends(std::span<const planned_layer> layers, copy_cost cost) {
  const std::size_t n = layers.size();
  std::vector<double> bytes(n + 1, 0), compute(n + 1, 0);  // prefix sums
  for (std::size_t i = 0; i < n; ++i) {
    bytes[i + 1] = bytes[i] + layers[i].bytes;
    compute[i + 1] = compute[i] + layers[i].compute_seconds;
  }
  constexpr double never = std::numeric_limits<double>::infinity();
  // end[k][i]: the earliest completion of layer i-1 when layers 0..i-1 form
  // k groups; from[k][i]: where the last of those groups starts.
  std::vector<std::vector<double>> end(n + 1, std::vector<double>(n + 1, never));
  std::vector<std::vector<std::size_t>> from(n + 1, std::vector<std::size_t>(n + 1, 0));
  end[0][0] = 0;
  std::size_t best_k = 0;
  double best = never;
  for (std::size_t k = 1; k <= n; ++k) {
    const double overhead = static_cast<double>(k) * cost.per_group_seconds;
    for (std::size_t i = k; i <= n; ++i) {
      const double group_ready = overhead + bytes[i] / cost.bytes_per_second;  // F: depends on i and k only
      double e = never;
      std::size_t arg = 0;
      for (std::size_t j = k - 1; j < i; ++j) {
        if (end[k - 1][j] == never) continue;
        const double candidate = std::max(end[k - 1][j], group_ready) + (compute[i] - compute[j]);
        if (candidate < e) {
          e = candidate;
          arg = j;
        }
      }
      end[k][i] = e;
      from[k][i] = arg;
    }
    if (end[k][n] < best) {  // strictly better: fewer groups win ties
      best = end[k][n];
      best_k = k;
    }
  }
  if (best_k == 0) {
    throw invalid_argument(
        "plan_groups: no grouping has a finite completion time (a bandwidth too small, or times too "
        "large)");
  }
  std::vector<std::size_t> ends(best_k);
  std::size_t i = n;
  for (std::size_t k = best_k; k >= 1; --k) {
    ends[k - 1] = i;
    i = from[k][i];
  }
  return ends;
}

}  // namespace

group_plan evaluate_grouping(std::span<const layer_cost> layers, copy_cost cost, std::vector<std::size_t> group_ends) {
  validate(layers, cost);
  if (group_ends.empty() || group_ends.back() != layers.size()) {
    throw invalid_argument("evaluate_grouping: the groups must end at the layer count (" +
                           std::to_string(layers.size()) + ")");
  }
  // Every end checked before any is used: an end past the layers would read past them.
  for (std::size_t g = 0, previous = 0; g < group_ends.size(); previous = group_ends[g++]) {
    if (group_ends[g] <= previous || group_ends[g] > layers.size()) {
      throw invalid_argument("evaluate_grouping: group ends must increase, each at most the layer count (" +
                             std::to_string(layers.size()) + "); end " + std::to_string(g) + " is " +
                             std::to_string(group_ends[g]));
    }
  }
  group_plan plan;
  double ready = 0, done = 0;
  std::size_t begin = 0;
  for (std::size_t g = 0; g < group_ends.size(); ++g) {
    double bytes = 0, compute = 0;
    for (std::size_t i = begin; i < group_ends[g]; ++i) {
      bytes += static_cast<double>(layers[i].bytes);
      compute += layers[i].compute_seconds;
    }
    ready += cost.per_group_seconds + bytes / cost.bytes_per_second;
    if (g == 0) plan.first_layer_start = ready;
    done = std::max(done, ready) + compute;
    begin = group_ends[g];
  }
  plan.last_layer_end = done;
  plan.group_ends = std::move(group_ends);
  return plan;
}

group_plan plan_groups(std::span<const layer_cost> layers, copy_cost cost) {
  validate(layers, cost);
  const std::size_t unit = (layers.size() + max_planned_layers - 1) / max_planned_layers;
  if (unit == 1) return evaluate_grouping(layers, cost, optimal_ends(merged_runs(layers, 1), cost));
  std::vector<std::size_t> ends;
  for (std::size_t e : optimal_ends(merged_runs(layers, unit), cost)) ends.push_back(std::min(e * unit, layers.size()));
  // Optimal at the coarse granularity only: it must not lose to the groupings
  // it is compared against.
  group_plan best = evaluate_grouping(layers, cost, std::move(ends));
  for (group_plan other : {one_group_per_layer(layers, cost), one_group_for_all(layers, cost)}) {
    if (other.last_layer_end < best.last_layer_end) best = std::move(other);
  }
  return best;
}

group_plan one_group_per_layer(std::span<const layer_cost> layers, copy_cost cost) {
  std::vector<std::size_t> ends(layers.size());
  for (std::size_t i = 0; i < ends.size(); ++i) ends[i] = i + 1;
  return evaluate_grouping(layers, cost, std::move(ends));
}

group_plan one_group_for_all(std::span<const layer_cost> layers, copy_cost cost) {
  return evaluate_grouping(layers, cost, {layers.size()});
}

}  // namespace shoal::transfer
