// Argument checks shared by every flat-partition optimizer (CPU and CUDA):
// one message style, raised before any memory is touched.
#pragma once
#include <initializer_list>
#include <utility>

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

// True when `t` was passed (a default-constructed Tensor means "none").
inline bool is_given(const Tensor& t) { return t.owner() != nullptr || t.data() != nullptr; }

}  // namespace zerocore
