// Optimizers on flat fp32 partitions, for the host (ZeRO-Offload's CPU
// step). One pass per call reads the gradient (fp32, bf16 or fp16) and the
// fp32 state, multiplies the gradient by `grad_scale` (loss-scale unscaling
// and clipping folded in), updates the fp32 params and state, and optionally
// writes a bf16/fp16 copy of the new params. Semantics follow torch.optim
// (bias correction, eps outside the square root, decoupled or L2 weight
// decay, SGD momentum with dampening and nesterov). The work is split over
// default_thread_pool() and runs on active_isa().
#pragma once
#include <cstdint>
#include <vector>

#include "zerocore/kernels/flat_run.h"
#include "zerocore/kernels/optim.h"
#include "zerocore/tensor.h"

namespace zerocore {

// `step` counts from 1 (the first update). `param_copy` may be an
// undefined (default-constructed) tensor. Throws InvalidArgument /
// TypeMismatch on a bad argument, before touching any memory.
void adam_update(const AdamOptions& options, int64_t step, double grad_scale, const Tensor& param,
                 const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                 const Tensor& param_copy);

// With momentum, `momentum_buffer` is required; on step 1 it is set to the
// gradient (as torch does when it creates the buffer).
void sgd_update(const SgdOptions& options, int64_t step, double grad_scale, const Tensor& param,
                const Tensor& grad, const Tensor& momentum_buffer, const Tensor& param_copy);

// One step over every run, in one pass of the thread pool, each run with
// the options of its group: a whole partition in one call, however many
// runs and groups it has. Every run and every group's options are checked
// before any memory is touched.
void adam_update_runs(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                      const std::vector<FlatRun>& runs);
void sgd_update_runs(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                     const std::vector<FlatRun>& runs);

}  // namespace zerocore
