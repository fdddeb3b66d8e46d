// zerocore._native.EngineCore: the engine's native core (cpp/include/
// zerocore/engine/engine_core.h), built from the flat groups' stores, the
// units and the placement; the Python engine takes its parts from it
// (python/zerocore/engine.py) and wires none of them.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "bound_queue.h"
#include "dlpack_tensor.h"
#include "zerocore/engine/engine_core.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

// (store, tag, reduced or None) per flat group, as Python gives them.
std::vector<EngineCore::Group> groups_of(const nb::list& groups) {
  std::vector<EngineCore::Group> out;
  for (nb::handle item : groups) {
    const auto t = nb::cast<nb::tuple>(item);
    if (t.size() != 3) throw nb::value_error("EngineCore: each group is (store, tag, reduced or None)");
    EngineCore::Group g{&nb::cast<PartitionStore&>(t[0]), nb::cast<int32_t>(t[1]), {}};
    if (!t[2].is_none()) g.reduced = tensor_from_dlpack(t[2], "EngineCore: a group's reduced buffer");
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<EngineCore::Reduced> order_of(const std::vector<std::tuple<int, int32_t>>& order) {
  std::vector<EngineCore::Reduced> out;
  for (const auto& [group, tag] : order) out.push_back({group, tag});
  return out;
}

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<EngineCore>(m, "EngineCore",
                         "The engine's native core (engine/engine_core.h): gradient reduction, stage 3's unit "
                         "schedule, the step's collectives, the offloaded host update and the step, built and "
                         "connected from the flat groups' stores, the units and the placement.")
      .def(
          "__init__",
          [](EngineCore* self, const BoundQueue& data, const BoundQueue& control, const nb::list& groups,
             const std::vector<std::tuple<bool, std::vector<int>>>& units, int stage, const BoundQueue* reductions,
             const BoundQueue* rounds, OffloadOptimizer* offload, std::optional<int64_t> delays_from,
             LossScaler* loss_scaler, std::optional<int> staging_buffers, int64_t prefetch_bytes) {
            EngineCore::Description d;
            d.queues = {&data.get(), &control.get(), reductions ? &reductions->get() : nullptr,
                        rounds ? &rounds->get() : nullptr};
            d.groups = groups_of(groups);
            for (const auto& [own_slot, members] : units) d.units.push_back({members, own_slot});
            d.stage = stage;
            d.offload = offload;
            d.delays_from = delays_from;
            d.loss_scaler = loss_scaler;
            d.staging_buffers = staging_buffers;
            d.prefetch_bytes = prefetch_bytes;
            new (self) EngineCore(d);
          },
          "data"_a, "control"_a, "groups"_a, "units"_a, nb::kw_only(), "stage"_a, "reductions"_a.none() = nb::none(),
          "rounds"_a.none() = nb::none(), "offload"_a.none() = nb::none(), "delays_from"_a.none() = nb::none(),
          "loss_scaler"_a.none() = nb::none(), "staging_buffers"_a.none() = nb::none(), "prefetch_bytes"_a = 1,
          nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>(), nb::keep_alive<1, 4>(), nb::keep_alive<1, 7>(),
          nb::keep_alive<1, 8>(), nb::keep_alive<1, 9>(), nb::keep_alive<1, 11>(),
          "groups: per flat group, in the reduction order, (PartitionStore, tag, reduced): reduced, "
          "Config(deterministic=True)'s int64 sums reduction adds into instead of the grads, or None. units "
          "(stage 3): per unit (own_slot, [indices into groups]). reductions: stages 2-3's reducer's queue, "
          "where it is not data; rounds: stage 3's. offload: the OffloadOptimizer the host update drives, "
          "delays_from its first delayed step. staging_buffers: the reducer's (None: as the core plans them). Raises ValueError naming what is wrong with the description.")
      .def_prop_ro("stage", &EngineCore::stage)
      .def_prop_ro("zero_step", &EngineCore::zero_step, nb::rv_policy::reference_internal, "The ZeroStep.")
      .def_prop_ro("grad_reduce", &EngineCore::grad_reduce, nb::rv_policy::reference_internal,
                   "Stages 0-1: the BucketCollectives reducing every trainable group's grads (None elsewhere).")
      .def_prop_ro("param_gather", &EngineCore::param_gather, nb::rv_policy::reference_internal,
                   "Stages 1-3: the BucketCollectives gathering the groups kept whole after the update, or None.")
      .def_prop_ro("reducer", &EngineCore::reducer, nb::rv_policy::reference_internal,
                   "Stages 2-3: the BucketReducer (None elsewhere); another after set_reduction_order.")
      .def_prop_ro("schedule", &EngineCore::schedule, nb::rv_policy::reference_internal,
                   "Stage 3: the UnitSchedule (None elsewhere).")
      .def_prop_ro("host_update", &EngineCore::host_update, nb::rv_policy::reference_internal,
                   "Offloaded: the HostUpdate the step drives (None elsewhere).")
      .def("follow_swaps", &EngineCore::follow_swaps,
           "After a step call: the stores follow the host grad swaps the host update made (the reducer from "
           "the next before_backward); returns how many.")
      .def("before_backward", &EngineCore::before_backward,
           "Before a backward: the reducer adds into the grad buffers now in the stores.")
      .def(
          "set_reduction_order",
          [](EngineCore& self, const std::vector<std::tuple<int, int32_t>>& order) {
            self.set_reduction_order(order_of(order));
          },
          "order"_a,
          "Test only: [(group index, tag)] reduced in this order from now on (the reducer is rebuilt; stage 3's "
          "rounds keep each unit's places of the order).");
}

}  // namespace zerocore::bindings
