// The unit an optimizer step updates, on any backend: a stretch of a rank's
// partition, its params, grads and states as flat tensors. Here, apart from
// the CPU kernels (cpu_optim.h), so the backend seam (backend/backend.h)
// and the stores that hand runs out do not depend on them.
#pragma once
#include "zerocore/tensor.h"

namespace zerocore {

// A stretch of a rank's partition whose elements all belong to one
// optimizer param group: what a multi-run step updates. Undefined
// (default-constructed) tensors mean "none".
struct FlatRun {
  int param_group = 0;  // index into the step's per-param-group options
  Tensor param;       // fp32
  Tensor grad;        // fp32, bf16 or fp16
  Tensor state0;      // Adam exp_avg, SGD momentum buffer
  Tensor state1;      // Adam exp_avg_sq
  Tensor param_copy;  // bf16/fp16 copy of the new params
};

}  // namespace zerocore
