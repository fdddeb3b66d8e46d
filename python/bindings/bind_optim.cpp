#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "dlpack_tensor.h"
#include "flat_runs.h"
#include "bound_backend.h"
#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/kernels/cpu_reduce.h"
#include "zerocore/error.h"
#include "zerocore/offload/offload_optimizer.h"
#include "zerocore/kernels/optim_args.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

// The optimizers work on flat partitions: 1-D tensors only, so a caller who
// passes a shaped param learns to flatten it rather than getting a reshape.
Tensor flat(nb::handle obj, const char* op, const char* name, bool optional = false) {
  const std::string where = std::string(op) + ": " + name;
  Tensor t = optional ? optional_tensor_from_dlpack(obj, where.c_str()) : tensor_from_dlpack(obj, where.c_str());
  if (is_given(t) && t.shape().size() != 1) {
    std::string shape;
    for (int64_t d : t.shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    throw InvalidArgument(where + " must be 1-D (use .view(-1)), got shape (" + shape + ")");
  }
  return t;
}

}  // namespace

std::vector<AdamOptions> adam_groups(const nb::list& groups, bool adamw) {
  std::vector<AdamOptions> out;
  for (nb::handle h : groups) {
    nb::dict g = nb::cast<nb::dict>(h);
    nb::tuple betas = nb::cast<nb::tuple>(g["betas"]);
    out.push_back(AdamOptions{nb::cast<double>(g["lr"]), nb::cast<double>(betas[0]), nb::cast<double>(betas[1]),
                              nb::cast<double>(g["eps"]), nb::cast<double>(g["weight_decay"]), adamw});
  }
  return out;
}

std::vector<SgdOptions> sgd_groups(const nb::list& groups) {
  std::vector<SgdOptions> out;
  for (nb::handle h : groups) {
    nb::dict g = nb::cast<nb::dict>(h);
    out.push_back(SgdOptions{nb::cast<double>(g["lr"]), nb::cast<double>(g["momentum"]),
                             nb::cast<double>(g["dampening"]), nb::cast<double>(g["weight_decay"]),
                             nb::cast<bool>(g["nesterov"])});
  }
  return out;
}

namespace {

FlatRuns make_runs(const std::vector<int>& groups, const nb::list& params, const nb::list& grads,
                   const nb::list& state0, const nb::list& state1, const nb::list& copies) {
  const size_t n = groups.size();
  if (nb::len(params) != n || nb::len(grads) != n || nb::len(state0) != n || nb::len(state1) != n ||
      nb::len(copies) != n) {
    throw InvalidArgument("FlatRuns: groups, params, grads, state0, state1 and copies must have one entry per run");
  }
  FlatRuns out;
  for (size_t i = 0; i < n; ++i) {
    out.runs.push_back(FlatRun{groups[i], flat(params[i], "FlatRuns", "param"), flat(grads[i], "FlatRuns", "grad"),
                               flat(state0[i], "FlatRuns", "state0", true), flat(state1[i], "FlatRuns", "state1", true),
                               flat(copies[i], "FlatRuns", "param_copy", true)});
    out.grads.push_back(out.runs.back().grad);
  }
  return out;
}

std::vector<TensorCopy> copies(const nb::list& pairs, const char* what) {
  std::vector<TensorCopy> out;
  for (nb::handle pair : pairs) {
    nb::tuple t = nb::cast<nb::tuple>(pair);
    out.push_back(TensorCopy{flat(t[0], "OffloadOptimizer", what), flat(t[1], "OffloadOptimizer", what)});
  }
  return out;
}

}  // namespace

void bind_optim(nb::module_& m) {
  nb::class_<FlatRuns>(m, "FlatRuns",
                       "A rank's partition as runs (stretches of flat fp32 params, each in one optimizer param "
                       "group), with their grads, states and 16-bit copies; one call steps them all.")
      .def(nb::new_(&make_runs), "groups"_a, "params"_a, "grads"_a, "state0"_a, "state1"_a, "param_copies"_a,
           "Per run: its param group index, fp32 param, grad (fp32/bf16/fp16), state0 (Adam exp_avg, SGD "
           "momentum buffer), state1 (Adam exp_avg_sq) and param copy (bf16/fp16); None where there is none.")
      .def(
          "adam_",
          [](const FlatRuns& self, const nb::list& groups, int64_t step, double grad_scale, bool adamw) {
            const std::vector<AdamOptions> options = adam_groups(groups, adamw);
            nb::gil_scoped_release release;
            adam_update_runs(options, step, grad_scale, self.runs);
          },
          "groups"_a, nb::kw_only(), "step"_a, "grad_scale"_a, "adamw"_a,
          "Adam/AdamW step of every run; groups: the param groups' hyperparameter dicts.")
      .def(
          "sgd_",
          [](const FlatRuns& self, const nb::list& groups, int64_t step, double grad_scale) {
            const std::vector<SgdOptions> options = sgd_groups(groups);
            nb::gil_scoped_release release;
            sgd_update_runs(options, step, grad_scale, self.runs);
          },
          "groups"_a, nb::kw_only(), "step"_a, "grad_scale"_a,
          "SGD step of every run; groups: the param groups' hyperparameter dicts.")
      .def(
          "grad_sum_of_squares",
          [](const FlatRuns& self) {
            nb::gil_scoped_release release;
            return sum_of_squares(self.grads);
          },
          "The sum of squares of every run's grad, in fp64 (non-finite if any grad element is).")
      .def("__len__", [](const FlatRuns& self) { return self.runs.size(); });
  m.def(
      "sum_of_squares",
      [](const nb::list& tensors) {
        std::vector<Tensor> xs;
        for (nb::handle t : tensors) xs.push_back(flat(t, "sum_of_squares", "tensor"));
        nb::gil_scoped_release release;
        return sum_of_squares(xs);
      },
      "tensors"_a,
      "The sum of squares of every element of the 1-D host tensors (fp32/bf16/fp16), accumulated in fp64 in "
      "one multi-threaded pass; non-finite exactly when some element is.");
  m.def(
      "adam_",
      [](nb::handle param, nb::handle grad, nb::handle exp_avg, nb::handle exp_avg_sq, int64_t step, double lr,
         double beta1, double beta2, double eps, double weight_decay, bool adamw, double grad_scale,
         nb::handle param_copy) {
        const Tensor p = flat(param, "adam_", "param"), g = flat(grad, "adam_", "grad"),
                     m1 = flat(exp_avg, "adam_", "exp_avg"), v = flat(exp_avg_sq, "adam_", "exp_avg_sq"),
                     c = flat(param_copy, "adam_", "param_copy", true);
        nb::gil_scoped_release release;
        adam_update(AdamOptions{lr, beta1, beta2, eps, weight_decay, adamw}, step, grad_scale, p, g, m1, v, c);
      },
      "param"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, nb::kw_only(), "step"_a, "lr"_a, "beta1"_a = 0.9,
      "beta2"_a = 0.999, "eps"_a = 1e-8, "weight_decay"_a = 0.0, "adamw"_a = true, "grad_scale"_a = 1.0,
      "param_copy"_a = nb::none(),
      "In-place Adam/AdamW step on flat fp32 tensors (torch.optim semantics); grad may be fp32/bf16/fp16 "
      "and is multiplied by grad_scale; param_copy (bf16/fp16) receives the new params in the same pass.");
  m.def(
      "sgd_",
      [](nb::handle param, nb::handle grad, nb::handle momentum_buffer, int64_t step, double lr, double momentum,
         double dampening, double weight_decay, bool nesterov, double grad_scale, nb::handle param_copy) {
        const Tensor p = flat(param, "sgd_", "param"), g = flat(grad, "sgd_", "grad"),
                     b = flat(momentum_buffer, "sgd_", "momentum_buffer", true),
                     c = flat(param_copy, "sgd_", "param_copy", true);
        nb::gil_scoped_release release;
        sgd_update(SgdOptions{lr, momentum, dampening, weight_decay, nesterov}, step, grad_scale, p, g, b, c);
      },
      "param"_a, "grad"_a, "momentum_buffer"_a = nb::none(), nb::kw_only(), "step"_a, "lr"_a,
      "momentum"_a = 0.0, "dampening"_a = 0.0, "weight_decay"_a = 0.0, "nesterov"_a = false,
      "grad_scale"_a = 1.0, "param_copy"_a = nb::none(),
      "In-place SGD step (torch.optim.SGD semantics) on flat fp32 tensors; on step 1 the momentum buffer "
      "is set to the gradient.");

  nb::class_<OffloadOptimizer>(m, "OffloadOptimizer",
                               "ZeRO-Offload's host step over a partition in buckets: grads down, the CPU "
                               "optimizer and params up on two streams of its backend, ordered by its events "
                               "(offload_optimizer.h).")
      .def(
          "__init__",
          [](OffloadOptimizer* self, const nb::list& buckets, const BoundBackend& backend) {
            std::vector<OffloadBucket> out;
            for (nb::handle item : buckets) {
              nb::tuple b = nb::cast<nb::tuple>(item);
              std::vector<Tensor> spares;
              if (b.size() > 3) {
                for (nb::handle t : nb::cast<nb::list>(b[3])) spares.push_back(flat(t, "OffloadOptimizer", "spare grad"));
              }
              out.push_back(OffloadBucket{nb::cast<const FlatRuns&>(b[0]).runs, copies(nb::cast<nb::list>(b[1]), "grad"),
                                          copies(nb::cast<nb::list>(b[2]), "param"), std::move(spares)});
            }
            new (self) OffloadOptimizer(std::move(out), backend.get());
          },
          "buckets"_a, "backend"_a, nb::keep_alive<1, 3>(),
          "buckets: per bucket, (FlatRuns of its host runs, [(device grad, host grad)], [(host param, param "
          "training reads)][, [spare grad per run]]). backend: the zerocore._native.Backend whose streams it runs "
          "on (kept alive).")
      .def("swap_grads", &OffloadOptimizer::swap_grads,
           "Each run's grad trades places with its spare (nothing may be queued).")
      .def("copy_grads", &OffloadOptimizer::copy_grads, "Queues every bucket's grads down.")
      .def(
          "adam_",
          [](OffloadOptimizer& self, const nb::list& groups, int64_t step, double grad_scale, bool adamw,
             bool copy_params) { self.adam(adam_groups(groups, adamw), step, grad_scale, copy_params); },
          "groups"_a, nb::kw_only(), "step"_a, "grad_scale"_a, "adamw"_a, "copy_params"_a,
          "Queues the Adam/AdamW update of every bucket (options read now); with copy_params, each bucket's "
          "params go up once it is updated.")
      .def(
          "sgd_",
          [](OffloadOptimizer& self, const nb::list& groups, int64_t step, double grad_scale, bool copy_params) {
            self.sgd(sgd_groups(groups), step, grad_scale, copy_params);
          },
          "groups"_a, nb::kw_only(), "step"_a, "grad_scale"_a, "copy_params"_a,
          "Queues the SGD update of every bucket (options read now), as adam_.")
      .def("copy_params", &OffloadOptimizer::copy_params, "Queues every bucket's params up, after the updates.")
      .def(
          "wait",
          [](OffloadOptimizer& self) {
            nb::gil_scoped_release release;
            self.wait();
          },
          "Returns once everything queued has run; raises the first error.")
      .def_prop_ro("busy", &OffloadOptimizer::busy)
      .def(
          "grad_sum_of_squares",
          [](const OffloadOptimizer& self) {
            nb::gil_scoped_release release;
            return self.grad_sum_of_squares();
          },
          "The fp64 sum of squares of every run's host grad (after wait()).");
}

}  // namespace zerocore::bindings
