// The _cuda extension module: CUDA device discovery and the fused Adam/AdamW
// update on flat partitions. Tensors cross as DLPack (zero-copy); the caller
// passes the raw cudaStream_t of the stream to run on (torch's current
// stream), so the update is ordered with the caller's other work. Nothing
// here touches CUDA at import time: the module loads without a driver.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "dlpack_tensor.h"
#include "zerocore/cuda_optim.h"
#include "zerocore/error.h"
#include "zerocore/kernels/optim_args.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Flat partitions only, as in the CPU module: a shaped tensor is refused
// (ValueError) rather than silently flattened.
zerocore::Tensor flat(nb::handle obj, const char* name, bool optional = false) {
  using namespace zerocore::bindings;
  const std::string where = std::string("adam_: ") + name;
  zerocore::Tensor t = optional ? optional_tensor_from_dlpack(obj, where.c_str())
                                : tensor_from_dlpack(obj, where.c_str());
  if (zerocore::is_given(t) && t.shape().size() != 1) {
    std::string shape;
    for (int64_t d : t.shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    throw zerocore::InvalidArgument(where + " must be 1-D (use .view(-1)), got shape (" + shape +
                                    ")");
  }
  return t;
}

void adam(nb::handle param, nb::handle grad, nb::handle exp_avg, nb::handle exp_avg_sq,
          int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
          bool adamw, double grad_scale, nb::handle param_copy, uintptr_t stream) {
  const zerocore::Tensor p = flat(param, "param");
  const zerocore::Tensor g = flat(grad, "grad");
  const zerocore::Tensor m = flat(exp_avg, "exp_avg");
  const zerocore::Tensor v = flat(exp_avg_sq, "exp_avg_sq");
  const zerocore::Tensor c = flat(param_copy, "param_copy", /*optional=*/true);

  zerocore::AdamOptions options;
  options.lr = lr;
  options.beta1 = beta1;
  options.beta2 = beta2;
  options.eps = eps;
  options.weight_decay = weight_decay;
  options.adamw = adamw;

  // The tensors (whose owners hold Python references) outlive this scope,
  // so they are released with the GIL held.
  nb::gil_scoped_release no_gil;
  zerocore::cuda_adam_update(options, step, grad_scale, p, g, m, v, c,
                             reinterpret_cast<void*>(stream));
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "zerocore CUDA kernels (fused optimizers on flat partitions)";
  zerocore::bindings::register_error_translators();

  m.def("device_count", &zerocore::cuda_device_count,
        "Number of usable CUDA devices; 0 without a driver or device.");
  m.def("unavailable_reason", &zerocore::cuda_unavailable_reason,
        "Why no CUDA device can be used, in CUDA's words; '' when one can.");

  m.def("adam_", &adam, "param"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, nb::kw_only(),
        "step"_a, "lr"_a, "beta1"_a = 0.9, "beta2"_a = 0.999, "eps"_a = 1e-8,
        "weight_decay"_a = 0.0, "adamw"_a = true, "grad_scale"_a = 1.0,
        "param_copy"_a = nb::none(), "stream"_a = 0,
        "Fused Adam/AdamW step on flat (1-D) fp32 CUDA partitions, in place, queued on `stream` "
        "(a cudaStream_t as an int; 0 is the default stream). The gradient may be "
        "float32/bfloat16/float16 and is multiplied by grad_scale; param_copy, if given, "
        "receives the new params as bfloat16/float16.");
}
