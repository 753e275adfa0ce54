// The group planner: its optimum matches an exhaustive search over every
// grouping of small random models, is never worse than one group per layer
// or one group for the model, and reduces to them at the extremes; bad input
// refused; large models planned at a coarser granularity.
#include "shoal/transfer/group_planner.h"

#include <gtest/gtest.h>

#include <random>

#include "shoal/core/error.h"

namespace shoal::testing {
namespace {

using transfer::copy_cost;
using transfer::layer_cost;

std::vector<layer_cost> random_model(std::mt19937& rng, std::size_t n) {
  std::uniform_int_distribution<std::size_t> bytes(0, 64 << 20);
  std::uniform_real_distribution<double> compute(0, 2e-3);
  std::vector<layer_cost> layers(n);
  for (auto& l : layers) l = {bytes(rng), compute(rng)};
  return layers;
}

/// The best completion time over all 2^(n-1) groupings.
double exhaustive_best(const std::vector<layer_cost>& layers, copy_cost cost) {
  const std::size_t n = layers.size();
  double best = std::numeric_limits<double>::infinity();
  for (std::uint64_t cuts = 0; cuts < (std::uint64_t{1} << (n - 1)); ++cuts) {
    std::vector<std::size_t> ends;
    for (std::size_t i = 1; i < n; ++i) {
      if ((cuts >> (i - 1)) & 1U) ends.push_back(i);
    }
    ends.push_back(n);
    best = std::min(best, transfer::evaluate_grouping(layers, cost, ends).last_layer_end);
  }
  return best;
}

TEST(group_planner, the_plan_is_the_best_of_every_grouping_on_random_models) {
  std::mt19937 rng(20261124);
  for (int model = 0; model < 40; ++model) {
    const auto layers = random_model(rng, 2 + model % 11);
    const copy_cost cost{std::uniform_real_distribution<double>(0, 1e-3)(rng), 25e9};
    const auto plan = transfer::plan_groups(layers, cost);
    EXPECT_NEAR(plan.last_layer_end, exhaustive_best(layers, cost), 1e-12) << "model " << model;
    EXPECT_LE(plan.last_layer_end, transfer::one_group_per_layer(layers, cost).last_layer_end + 1e-12);
    EXPECT_LE(plan.last_layer_end, transfer::one_group_for_all(layers, cost).last_layer_end + 1e-12);
  }
}

TEST(group_planner, the_prediction_follows_the_copy_and_compute_timeline) {
  // Two layers of 1 GB at 1 GB/s, 0.5 s of compute each, 0.1 s per group.
  const std::vector<layer_cost> layers{{1'000'000'000, 0.5}, {1'000'000'000, 0.5}};
  const copy_cost cost{0.1, 1e9};
  const auto per_layer = transfer::one_group_per_layer(layers, cost);
  EXPECT_DOUBLE_EQ(per_layer.first_layer_start, 1.1);
  EXPECT_DOUBLE_EQ(per_layer.last_layer_end,
                   2.7);  // group 2 ready at 2.2, runs 0.5
  const auto whole = transfer::one_group_for_all(layers, cost);
  EXPECT_DOUBLE_EQ(whole.first_layer_start, 2.1);
  EXPECT_DOUBLE_EQ(whole.last_layer_end, 3.1);
  EXPECT_EQ(transfer::plan_groups(layers, cost).group_ends, (std::vector<std::size_t>{1, 2}));
}

TEST(group_planner, free_groups_split_every_layer_and_costly_groups_make_one) {
  std::mt19937 rng(7);
  auto layers = random_model(rng, 30);
  for (auto& l : layers) l.bytes += 1;  // every layer has bytes to copy
  const auto free_groups = transfer::plan_groups(layers, copy_cost{0, 10e9});
  EXPECT_DOUBLE_EQ(free_groups.last_layer_end,
                   transfer::one_group_per_layer(layers, copy_cost{0, 10e9}).last_layer_end);
  const auto costly = transfer::plan_groups(layers, copy_cost{100, 10e9});
  EXPECT_EQ(costly.group_ends, (std::vector<std::size_t>{30}));
}

TEST(group_planner, large_models_are_planned_in_runs_of_layers) {
  std::mt19937 rng(11);
  const auto layers = random_model(rng, 3000);
  const copy_cost cost{20e-6, 50e9};
  const auto plan = transfer::plan_groups(layers, cost);
  ASSERT_FALSE(plan.group_ends.empty());
  EXPECT_EQ(plan.group_ends.back(), layers.size());
  for (std::size_t g = 1; g < plan.group_ends.size(); ++g) EXPECT_LT(plan.group_ends[g - 1], plan.group_ends[g]);
  EXPECT_LE(plan.last_layer_end, transfer::one_group_for_all(layers, cost).last_layer_end);
  EXPECT_LE(plan.last_layer_end, transfer::one_group_per_layer(layers, cost).last_layer_end);
}

TEST(group_planner, merged_layers_of_huge_sizes_keep_their_cost) {
  // 2048 layers are planned in pairs. The last two hold 2^63 bytes each: their pair, summed in
  // 64 bits, wrapped to 0 and looked free, so the coarse plan put small layers behind it and lost
  // to one group per layer. Their copy takes 18,447 s here; every small layer's compute (2,046 s)
  // fits before it, so the best plan's last group is that pair alone.
  std::vector<layer_cost> layers(2048, layer_cost{1 << 20, 1.0});
  layers[2046].bytes = layers[2047].bytes = std::size_t{1} << 63;
  const copy_cost cost{0.5, 1e15};
  const auto plan = transfer::plan_groups(layers, cost);
  ASSERT_GE(plan.group_ends.size(), 2U);
  EXPECT_EQ(plan.group_ends[plan.group_ends.size() - 2], 2046U);
  EXPECT_LT(plan.last_layer_end, transfer::one_group_per_layer(layers, cost).last_layer_end - 100);
}

TEST(group_planner, bad_profiles_and_groupings_are_refused) {
  const std::vector<layer_cost> layers{{10, 0.1}, {10, 0.1}};
  EXPECT_THROW((void)transfer::plan_groups({}, copy_cost{0, 1}), invalid_argument);
  EXPECT_THROW((void)transfer::plan_groups(layers, copy_cost{0, 0}), invalid_argument);
  EXPECT_THROW((void)transfer::plan_groups(layers, copy_cost{-1, 1}), invalid_argument);
  EXPECT_THROW((void)transfer::plan_groups(std::vector<layer_cost>{{1, -1.0}}, copy_cost{0, 1}), invalid_argument);
  EXPECT_THROW((void)transfer::evaluate_grouping(layers, copy_cost{0, 1}, {1}), invalid_argument);
  EXPECT_THROW((void)transfer::evaluate_grouping(layers, copy_cost{0, 1}, {1, 1, 2}), invalid_argument);
  EXPECT_THROW((void)transfer::evaluate_grouping(layers, copy_cost{0, 1}, {}), invalid_argument);
  // An end past the layers, before a last end that is right: refused, never read past them.
  EXPECT_THROW((void)transfer::evaluate_grouping(layers, copy_cost{0, 1}, {2000000, 2}), invalid_argument);
  EXPECT_THROW((void)transfer::plan_groups(layers, copy_cost{0, 1e-310}), invalid_argument);
}

}  // namespace
}  // namespace shoal::testing
