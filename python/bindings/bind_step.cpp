// zerocore._native.ZeroStep: the engine's optimizer step, one call a step
// (cpp/include/zerocore/step/zero_step.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <string>

#include "bindings.h"
#include "bound_queue.h"
#include "flat_runs.h"
#include "python_transport.h"
#include "zerocore/error.h"
#include "zerocore/step/zero_step.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

// kind: the optimizer's ("adam", "adamw" or "sgd"); groups: its
// param_groups, read each step (schedulers change them).
StepOptions step_options(const std::string& kind, const nb::list& groups, int64_t step, double loss_scale,
                         std::optional<double> max_norm) {
  StepOptions out;
  if (kind == "sgd") {
    out.kind = OptimizerKind::kSgd;
    out.sgd = sgd_groups(groups);
  } else if (kind == "adam" || kind == "adamw") {
    out.adam = adam_groups(groups, kind == "adamw");
  } else {
    throw InvalidArgument("ZeroStep.step: kind " + kind + "; use \"adam\", \"adamw\" or \"sgd\"");
  }
  out.step = step;
  out.loss_scale = loss_scale;
  out.max_norm = max_norm;
  return out;
}

}  // namespace

void bind_step(nb::module_& m) {
  nb::class_<ZeroStep>(m, "ZeroStep",
                       "The optimizer step of a ZeRO rank in one call: the reduction's end, the norm, the one "
                       "control exchange (with the order check), the decision, the update and the param gather.")
      .def(
          "__init__",
          [](ZeroStep* self, const BoundQueue& data, const BoundQueue& control, const FlatRuns* runs,
             bool partitioned, BucketCollectives* grad_reduce, BucketCollectives* param_gather) {
            new (self) ZeroStep(ZeroStep::Parts{&data.get(), &control.get(),
                                                runs ? runs->runs : std::vector<FlatRun>{}, partitioned,
                                                grad_reduce, param_gather});
          },
          "data"_a, "control"_a, "runs"_a.none(), nb::kw_only(), "partitioned"_a, "grad_reduce"_a.none() = nb::none(),
          "param_gather"_a.none() = nb::none(), nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>(), nb::keep_alive<1, 4>(),
          nb::keep_alive<1, 6>(), nb::keep_alive<1, 7>(),
          "runs: this rank's partition (None: the caller updates, as offload does); partitioned: ranks hold "
          "disjoint parts of the grads; grad_reduce: stages 0-1's reduction; param_gather: stages 1-2's gather.")
      .def(
          "exchange",
          [](ZeroStep& self, int64_t changes, std::optional<double> local) -> nb::object {
            Exchanged out;
            std::optional<std::vector<CollectiveKey>> diverged;
            {
              nb::gil_scoped_release release;
              try {
                out = self.exchange(changes, local);
              } catch (CollectiveOrderDiverged& e) {
                diverged = std::move(e.trace);
              }
            }
            if (!diverged) return nb::make_tuple(out.sum_of_squares, out.changes, nb::none());
            nb::list trace;
            for (const CollectiveKey& k : *diverged) trace.append(key_tuple(k));
            return nb::make_tuple(nb::none(), nb::none(), trace);
          },
          "changes"_a, "local"_a = nb::none(),
          "Once a step: (global sum of squares, trainability changes summed over ranks, None), or, on every "
          "rank when ranks issued different collectives, (None, None, this rank's trace since the last step) "
          "for naming where they parted (Communicator.order_error).")
      .def(
          "step",
          [](ZeroStep& self, const std::string& kind, const nb::list& groups, int64_t step, double loss_scale,
             std::optional<double> max_norm) {
            const StepOptions options = step_options(kind, groups, step, loss_scale, max_norm);
            nb::gil_scoped_release release;
            const StepResult out = self.step(options);
            return std::make_tuple(out.applied, out.norm, out.grad_scale);
          },
          "kind"_a, "groups"_a, nb::kw_only(), "step"_a, "loss_scale"_a, "max_norm"_a.none(),
          "(applied, norm, grad_scale): the update when the grads are finite (applied is False otherwise, "
          "nothing changed).")
      .def("forget", &ZeroStep::forget, "The grads were dropped: the next step exchanges afresh.");
}

}  // namespace zerocore::bindings
