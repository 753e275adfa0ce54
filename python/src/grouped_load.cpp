// Python bindings of grouped loading: _load_groups (raw copies; shoal.loading
// builds the array and module API on top), GroupedLoad, and the group
// planner.
//
// GIL: enqueueing the copies, synchronizing, measuring and a load's end
// (which waits for its copies) release it; a load lets go of its sources
// (held Python objects) by taking the GIL.
#include "shoal/transfer/grouped_load.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "gil.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/transfer/group_planner.h"
#include "made_elsewhere.h"

namespace shoal::python {

namespace {

struct py_grouped_load {
  py_grouped_load(std::shared_ptr<stream_state> stream, transfer::grouped_load l)
      : copy_stream(std::move(stream)), load(std::move(l)) {}
  py_grouped_load(py_grouped_load&&) = default;
  py_grouped_load& operator=(py_grouped_load&&) = delete;
  py_grouped_load(const py_grouped_load&) = delete;
  py_grouped_load& operator=(const py_grouped_load&) = delete;
  // The load's end waits for its copies (grouped_load.h): with the GIL
  // released, which nanobind's dealloc holds, so that dropping a load does
  // not stop every other Python thread until they have run. Its sources'
  // owners are let go of by taking the GIL back (hold()).
  ~py_grouped_load() {
    detail::waiting_without_gil([&] { const transfer::grouped_load gone = std::move(load); });
  }

  // Declared first, destroyed last: the load's destruction waits for its
  // copies on this stream, which must still be alive then.
  std::shared_ptr<stream_state> copy_stream;
  transfer::grouped_load load;
};

using copy_tuple = std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>;  // destination, source, bytes
using layer_tuple = std::pair<std::size_t, double>;                          // bytes, compute seconds
using plan_tuple = std::tuple<std::vector<std::size_t>, double, double>;     // ends, first start, last end

std::vector<transfer::layer_cost> layers_of(const std::vector<layer_tuple>& layers) {
  std::vector<transfer::layer_cost> out;
  out.reserve(layers.size());
  for (const auto& [bytes, seconds] : layers) out.push_back({bytes, seconds});
  return out;
}

plan_tuple tuple_of(const transfer::group_plan& plan) {
  return {plan.group_ends, plan.first_layer_start, plan.last_layer_end};
}

}  // namespace

// Calling GroupedLoad() names these.
constexpr char grouped_load_made_by[] =
    "shoal.loading.GroupedLoad is not made by calling the class: shoal.loading.load_groups() makes one.";

void register_grouped_load(nb::module_& m) {
  nb::class_<py_grouped_load>(m, "GroupedLoad", made_elsewhere<grouped_load_made_by>(),
                              "Groups of host-to-device copies enqueued on a copy stream, an event after "
                              "each group. A stream waits for group k (and so for every group before it) "
                              "with wait(k, stream).")
      .def_prop_ro(
          "groups", [](const py_grouped_load& l) { return l.load.groups(); }, "Number of groups.")
      .def(
          "wait",
          [](const py_grouped_load& l, const python_int& group, const py_stream* stream) {
            const auto k = whole_number_of(group, "shoal.loading.GroupedLoad.wait", "group");
            auto s = stream_or_current(stream, l.copy_stream->device());
            l.load.wait_for_group(static_cast<std::size_t>(k), s->ref());
          },
          nb::arg("group"), nb::arg("stream").none() = nb::none(),
          "Work enqueued on ``stream`` (default: the current stream) from now on sees groups 0..group: a "
          "GPU-side wait, the caller does not block.")
      .def(
          "is_ready",
          [](const py_grouped_load& l, const python_int& group) {
            const auto k = whole_number_of(group, "shoal.loading.GroupedLoad.is_ready", "group");
            return l.load.is_group_ready(static_cast<std::size_t>(k));
          },
          nb::arg("group"), "True once groups 0..group have been copied.")
      .def(
          "synchronize_group",
          [](const py_grouped_load& l, const python_int& group) {
            const auto k = whole_number_of(group, "shoal.loading.GroupedLoad.synchronize_group", "group");
            const auto event = l.load.group_ready(static_cast<std::size_t>(k));
            released_gil release;
            l.copy_stream->device().synchronize_event(event);
          },
          nb::arg("group"), "Blocks until groups 0..group have been copied (GIL released).")
      .def(
          "synchronize", [](const py_grouped_load& l) { l.load.synchronize(); },
          nb::call_guard<released_gil>(), "Blocks until every group has been copied (GIL released).")
      .def("__repr__", [](const py_grouped_load& l) {
        const std::size_t groups = l.load.groups();
        std::size_t ready = 0;
        while (ready < groups && l.load.is_group_ready(ready)) ++ready;
        return "shoal.loading.GroupedLoad(" + std::to_string(groups) + " groups, " + std::to_string(ready) + " copied)";
      });

  m.def(
      "_load_groups",
      [](const std::vector<std::pair<std::vector<copy_tuple>, nb::object>>& groups, const py_stream& stream) {
        std::vector<transfer::load_group> native;
        native.reserve(groups.size());
        for (const auto& [copies, owner] : groups) {
          transfer::load_group g;
          g.copies.reserve(copies.size());
          for (const auto& [destination, source, bytes] : copies) {
            g.copies.push_back({reinterpret_cast<void*>(destination), reinterpret_cast<const void*>(source), bytes});
          }
          if (!owner.is_none()) g.keep_alive = hold(owner);
          native.push_back(std::move(g));
        }
        auto& device = stream.state->device();
        released_gil release;
        return py_grouped_load{stream.state, transfer::load_groups(device, stream.state->ref(), std::move(native))};
      },
      nb::arg("groups"), nb::arg("stream"),
      "Enqueues groups of (destination, source, nbytes) copies on ``stream``, each group with an owner "
      "kept alive until the load is gone (which waits for its copies). Raw addresses: use "
      "shoal.loading.load_groups.");

  m.def(
      "_measure_copy_cost",
      [](const py_stream& stream) {
        const auto cost = transfer::measure_copy_cost(stream.state->device(), stream.state->ref());
        return std::make_pair(cost.per_group_seconds, cost.bytes_per_second);
      },
      nb::arg("stream"), nb::call_guard<released_gil>(),
      "(per_group_seconds, bytes_per_second) measured on the stream's device.");
  m.def(
      "_plan_groups",
      [](const std::vector<layer_tuple>& layers, double per_group, double bytes_per_second, const char* grouping) {
        const auto native = layers_of(layers);
        const transfer::copy_cost cost{per_group, bytes_per_second};
        const std::string_view g(grouping);
        if (g == "optimal") return tuple_of(transfer::plan_groups(native, cost));
        if (g == "per_layer") return tuple_of(transfer::one_group_per_layer(native, cost));
        if (g == "whole") return tuple_of(transfer::one_group_for_all(native, cost));
        throw invalid_argument("shoal.loading.plan_groups: grouping must be 'optimal', 'per_layer' or 'whole'");
      },
      nb::arg("layers"), nb::arg("per_group_seconds"), nb::arg("bytes_per_second"), nb::arg("grouping"),
      "(group_ends, first_layer_start, last_layer_end) for layers of (bytes, compute_seconds).");
  m.def(
      "_evaluate_grouping",
      [](const std::vector<layer_tuple>& layers, double per_group, double bytes_per_second,
         std::vector<std::size_t> group_ends) {
        return tuple_of(
            transfer::evaluate_grouping(layers_of(layers), {per_group, bytes_per_second}, std::move(group_ends)));
      },
      nb::arg("layers"), nb::arg("per_group_seconds"), nb::arg("bytes_per_second"), nb::arg("group_ends"),
      "The predicted (group_ends, first_layer_start, last_layer_end) of a given grouping.");
}

}  // namespace shoal::python
