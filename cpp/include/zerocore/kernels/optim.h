// Hyperparameters of the flat-partition optimizers and the per-call
// coefficients derived from them. Shared by the CPU and CUDA paths, so both
// reject the same bad values with the same messages and round their
// coefficients identically.
#pragma once
#include <cstdint>

namespace zerocore {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;  // decoupled weight decay (AdamW) vs L2 in the gradient (Adam)
};

struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

// Computed once per call in double, handed to the kernels as float.
struct AdamCoefs {
  float grad_scale;
  float l2_decay;     // Adam: grad += l2_decay * param (0 for AdamW)
  float param_decay;  // AdamW: param *= param_decay (1 for Adam)
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_step_size;   // -lr / (1 - beta1^step)
  float inv_bias2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float eps;
};

struct SgdCoefs {
  float grad_scale;
  float l2_decay;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
  bool use_momentum;
  bool first_step;  // the momentum buffer starts as the gradient
  bool nesterov;
};

// Both throw InvalidArgument naming the bad value (step < 1, lr < 0,
// beta outside [0, 1), non-finite grad_scale, nesterov without momentum...).
AdamCoefs adam_coefs(const AdamOptions& options, int64_t step, double grad_scale);
SgdCoefs sgd_coefs(const SgdOptions& options, int64_t step, double grad_scale);

}  // namespace zerocore
