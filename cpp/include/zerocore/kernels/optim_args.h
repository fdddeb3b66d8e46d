// Argument checks shared by every flat-partition optimizer (CPU and CUDA):
// one message style, raised before any memory is touched.
#pragma once
#include <initializer_list>
#include <utility>
#include <vector>

#include "zerocore/kernels/cpu_optim.h"  // FlatRun

#include "zerocore/tensor.h"

namespace zerocore {

struct NamedTensor {
  const char* name;
  const Tensor* tensor;
};

// `param` must be float32 on `device`; `grad` float32/bfloat16/float16;
// every `state` tensor float32; `param_copy` (if defined, i.e. non-null
// data or non-empty owner) bfloat16 or float16; all the same number of
// elements and on `device`. Throws TypeMismatch (dtype, device) or
// InvalidArgument (sizes, step, hyperparameters) naming the argument.
void check_flat_update(const char* op, Device device, const Tensor& param, const Tensor& grad,
                       std::initializer_list<NamedTensor> state, const Tensor& param_copy);

// Every run of a multi-run step (cpu_optim.h, cuda_optim.h): its group
// has options (`groups` of them) and its tensors pass check_flat_update on
// `device` with the optimizer's state (SGD's momentum buffer only for a
// group with momentum). Messages name the run when there are several.
void check_adam_runs(Device device, size_t groups, const std::vector<FlatRun>& runs);
void check_sgd_runs(Device device, const std::vector<SgdOptions>& groups, const std::vector<FlatRun>& runs);

// True when `t` was passed (a default-constructed Tensor means "none").
inline bool is_given(const Tensor& t) { return t.owner() != nullptr || t.data() != nullptr; }

}  // namespace zerocore
