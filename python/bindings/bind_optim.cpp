#include <string>

#include "bindings.h"
#include "dlpack_tensor.h"
#include "zerocore/cpu_optim.h"
#include "zerocore/error.h"
#include "zerocore/optim_args.h"

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

void bind_optim(nb::module_& m) {
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
}

}  // namespace zerocore::bindings
