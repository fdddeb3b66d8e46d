// zerocore._native.ZeroStep: the engine's optimizer step, one call a step
// (cpp/include/zerocore/step/zero_step.h), its LossScaler
// (step/loss_scaler.h) and, for offload, its HostUpdate (step/host_update.h). The step's refusals reach Python as exceptions of
// their own: NonFiniteGradientError (zerocore's, a FloatingPointError),
// CollectiveOrderDiverged(message, trace) and TrainabilityChanged, which
// the engine turns into the errors that name what differed.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <string>

#include "bindings.h"
#include "bound_queue.h"
#include "flat_runs.h"
#include "python_transport.h"
#include "zerocore/error.h"
#include "zerocore/step/host_update.h"
#include "zerocore/step/zero_step.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

// kind: the optimizer's ("adam", "adamw" or "sgd"); groups: its
// param_groups, read each step (schedulers change them).
StepOptions step_options(const std::string& kind, const nb::list& groups, int64_t step,
                         std::optional<double> max_norm, int64_t changes) {
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
  out.max_norm = max_norm;
  out.changes = changes;
  return out;
}

PyObject* new_exception(nb::module_& m, const char* name, const char* doc, PyObject* base) {
  PyObject* type = PyErr_NewExceptionWithDoc((std::string("zerocore._native.") + name).c_str(), doc, base, nullptr);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::borrow(type);
  return type;
}

void bind_step_errors(nb::module_& m) {
  static PyObject* non_finite = new_exception(
      m, "NonFiniteGradientError",
      "Raised (on every rank) when gradients hold inf/NaN and no dynamic loss scaling is there to absorb it "
      "(fp32/bf16, or fp16 with the scale at its minimum); params and optimizer state are untouched.",
      PyExc_FloatingPointError);
  static PyObject* diverged = new_exception(
      m, "CollectiveOrderDiverged",
      "args: (message, this rank's trace of data-plane keys since the last step): ranks issued different "
      "collectives; nothing was updated.",
      PyExc_RuntimeError);
  static PyObject* trainability = new_exception(
      m, "TrainabilityChanged", "Some rank changed a param's requires_grad since wrap; nothing was updated.",
      PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const NonFiniteGradients& e) {
      PyErr_SetString(non_finite, e.what());
    } catch (const CollectiveOrderDiverged& e) {
      nb::list trace;
      for (const CollectiveKey& k : e.trace) trace.append(key_tuple(k));
      PyErr_SetObject(diverged, nb::make_tuple(e.what(), trace).ptr());
    } catch (const TrainabilityChanged& e) {
      PyErr_SetString(trainability, e.what());
    }
  });
}

}  // namespace

void bind_step(nb::module_& m) {
  bind_step_errors(m);
  m.attr("STEP_VERDICT_GROUP") = kStepVerdictGroup;

  nb::class_<LossScaler>(m, "LossScaler", "fp16 loss scaling, fixed or dynamic (step/loss_scaler.h).")
      .def(nb::init<double>(), "fixed"_a = 1.0, "A fixed scale (1: none).")
      .def_static(
          "dynamic_scale",
          [](double initial, int64_t window, int64_t hysteresis, double min_scale, bool consecutive_hysteresis,
             bool deepspeed_growth) {
            return LossScaler(
                DynamicScale{initial, window, hysteresis, min_scale, consecutive_hysteresis, deepspeed_growth});
          },
          "initial"_a, "window"_a, "hysteresis"_a, "min_scale"_a, "consecutive_hysteresis"_a, "deepspeed_growth"_a)
      .def_prop_ro("dynamic", &LossScaler::dynamic)
      .def_prop_ro("scale", &LossScaler::scale)
      .def("update", &LossScaler::update, "overflow"_a,
           "One step's outcome; raises NonFiniteGradientError on an overflow at the minimum scale.")
      .def(
          "state", [](const LossScaler& self) {
            const LossScaler::State& s = self.state();
            return std::make_tuple(s.scale, s.clean_steps, s.hysteresis);
          },
          "(scale, clean_steps, hysteresis): what a checkpoint keeps.")
      .def(
          "load",
          [](LossScaler& self, double scale, int64_t clean_steps, int64_t hysteresis) {
            self.load(LossScaler::State{scale, clean_steps, hysteresis});
          },
          "scale"_a, "clean_steps"_a, "hysteresis"_a, "A checkpoint's state (a fixed scale keeps its own).");

  nb::class_<HostUpdate>(m, "HostUpdate",
                         "ZeRO-Offload's update as the native step drives it, over an OffloadOptimizer: the host "
                         "grads taken (swapped or copied down), the update, its params up at once or, delayed, "
                         "at the next step boundary (step/host_update.h): EngineCore.host_update.")
      .def(
          "finish",
          [](HostUpdate& self) {
            nb::gil_scoped_release release;
            return self.finish();
          },
          "A pending update's params go up, then the host waits for everything queued (it reads the master "
          "params or states next); True when there was a pending update.")
      .def_prop_ro("pending", &HostUpdate::pending, "An update is queued whose params are not up yet.")
      .def_rw("serial", &HostUpdate::serial, "The params go up only once the whole update is done.")
      .def_prop_ro("grad_swaps", &HostUpdate::grad_swaps, "Swaps of the host grad buffers since construction.")
      .def_prop_ro("params_sent", &HostUpdate::params_sent, "Times the params went up since construction.");

  nb::class_<ZeroStep>(m, "ZeroStep",
                       "The optimizer step of a ZeRO rank in one call: the reduction's end, the norm, the one "
                       "control exchange (with the order check and the late grads), the decision with the loss "
                       "scaler, the update and the param gather or stage 3's end-of-step round.")
      .def(
          "__init__",
          [](ZeroStep* self, const BoundQueue& data, const BoundQueue& control, const FlatRuns* runs,
             bool partitioned, BucketCollectives* grad_reduce, BucketCollectives* param_gather, UnitSchedule* units,
             LossScaler* loss_scaler, HostUpdate* host_update, const BoundQueue* reductions) {
            ZeroStep::Parts parts{&data.get(), &control.get(), runs ? runs->runs : std::vector<FlatRun>{},
                                  partitioned, grad_reduce, param_gather};
            parts.reductions = reductions ? &reductions->get() : nullptr;
            parts.units = units;
            parts.loss_scaler = loss_scaler;
            parts.host_update = host_update;
            new (self) ZeroStep(std::move(parts));
          },
          "data"_a, "control"_a, "runs"_a.none(), nb::kw_only(), "partitioned"_a, "grad_reduce"_a.none() = nb::none(),
          "param_gather"_a.none() = nb::none(), "units"_a.none() = nb::none(), "loss_scaler"_a.none() = nb::none(),
          "host_update"_a.none() = nb::none(), "reductions"_a.none() = nb::none(), nb::keep_alive<1, 2>(),
          nb::keep_alive<1, 3>(), nb::keep_alive<1, 4>(), nb::keep_alive<1, 6>(), nb::keep_alive<1, 7>(),
          nb::keep_alive<1, 8>(), nb::keep_alive<1, 9>(), nb::keep_alive<1, 10>(), nb::keep_alive<1, 11>(),
          "runs: this rank's partition, updated in place (None with a host_update: offload's HostUpdate, which "
          "the step drives itself); partitioned: ranks hold disjoint parts of the grads; grad_reduce: stages "
          "0-1's reduction; param_gather: stages 1-2's gather; units: stage 3's UnitSchedule (its end-of-step "
          "round); loss_scaler: the LossScaler; reductions: stages 2-3's reducer's queue, where it is not the data "
          "queue (its order is checked too).")
      .def(
          "exchange",
          [](ZeroStep& self, int64_t changes) {
            nb::gil_scoped_release release;
            const Exchanged& out = self.exchange(changes);
            return std::make_tuple(out.sum_of_squares, out.changes);
          },
          "changes"_a,
          "Once a step: (global sum of squares, trainability changes summed over ranks); raises "
          "CollectiveOrderDiverged on every rank when ranks issued different collectives.")
      .def(
          "step",
          [](ZeroStep& self, const std::string& kind, const nb::list& groups, int64_t step,
             std::optional<double> max_norm, int64_t changes, std::optional<double> exact_sum_of_squares,
             bool regrid) {
            StepOptions options = step_options(kind, groups, step, max_norm, changes);
            if (exact_sum_of_squares) options.exact = StepOptions::Exact{*exact_sum_of_squares, regrid};
            nb::gil_scoped_release release;
            const StepResult out = self.step(options);
            return std::make_tuple(out.applied, out.norm, out.grad_scale);
          },
          "kind"_a, "groups"_a, nb::kw_only(), "step"_a, "max_norm"_a.none(), "changes"_a,
          "exact_sum_of_squares"_a.none() = nb::none(), "regrid"_a = false,
          "(applied, norm, grad_scale): the update when the grads are finite, a skipped step (applied False) "
          "with dynamic loss scaling otherwise; raises NonFiniteGradientError, CollectiveOrderDiverged or "
          "TrainabilityChanged with nothing changed. exact_sum_of_squares (Config(deterministic=True)): the "
          "grad buffers hold the mean over every micro-batch of every rank, whose sum of squares this is; "
          "regrid: skip the step (a grad fell outside the exact sum's grid). Decided on the device (no dynamic "
          "scaling, clipping, offload or exact sum), norm is NaN and a refused step raises "
          "NonFiniteGradientError at a later step (see refused_step).")
      .def(
          "settle",
          [](ZeroStep& self) {
            nb::gil_scoped_release release;
            self.settle();
          },
          "Reads every verdict of the device, waiting; raises NonFiniteGradientError if a step was refused. "
          "On every rank, before params or states are read.")
      .def_prop_ro("refused_step", &ZeroStep::refused_step,
                   "The first step refused by the last NonFiniteGradientError (0: none): step_count goes back to "
                   "one less.")
      .def_prop_ro("buffer_bytes", &ZeroStep::buffer_bytes,
                   "Bytes of the step's own host buffers (its exchange row, its verdict's readbacks: pinned host "
                   "memory of its backend).")
      .def_prop_ro("device_buffer_bytes", &ZeroStep::device_buffer_bytes,
                   "Bytes of the step's own device buffer (its verdict's flag).")
      .def("forget", &ZeroStep::forget, "The grads were dropped: the next step exchanges afresh.")
      .def_prop_ro("exchanged", &ZeroStep::exchanged, "This step's exchange ran (its result is kept).")
      .def_prop_ro("loss_scale", &ZeroStep::loss_scale);
}

}  // namespace zerocore::bindings
