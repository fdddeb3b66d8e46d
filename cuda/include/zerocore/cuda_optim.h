// Optimizers on flat fp32 partitions, on a CUDA device: the GPU twin of
// cpu_optim.h, with the same semantics (torch.optim's Adam/AdamW and SGD,
// gradient multiplied by `grad_scale`, optional bf16/fp16 param copy written
// in the same pass) and the same rounding: both instantiate the element
// functions of kernels/element_math.h, so for the same inputs the CUDA and
// CPU updates give bit-identical params, state and copy. Every run of a call
// is updated in one launch per grad/copy dtype combination. Kernels are
// queued on `stream` (a cudaStream_t; nullptr is the legacy default stream)
// and run asynchronously: the call returns once the work is launched. This header needs no CUDA headers, so a C++ trainer can
// include it without nvcc.
#pragma once
#include <cstdint>
#include <string>

#include <vector>

#include "zerocore/kernels/cpu_optim.h"  // AdamOptions, SgdOptions, FlatRun
#include "zerocore/tensor.h"

namespace zerocore {

// Number of CUDA devices this process can use. Returns 0, never throws, when
// there is no driver, no device, or the driver is too old for the runtime.
int cuda_device_count();

// Why no device can be used, in CUDA's words (e.g. "cudaErrorInsufficientDriver:
// CUDA driver version is insufficient for CUDA runtime version"); empty when
// cuda_device_count() > 0. Never throws.
std::string cuda_unavailable_reason();

// Every tensor of every run must be on one CUDA device (the first run's
// param's); at most 32 param groups a call. `step` counts from 1. Throws
// InvalidArgument / TypeMismatch on a bad argument before launching
// anything, and InvalidArgument or std::runtime_error (with CUDA's message)
// when a CUDA call fails. A call with a set of runs not seen before uploads
// their table to the device once (a synchronous copy); later calls with the
// same runs allocate, copy and synchronise nothing. skip_if: null, or one
// fp32 element of device memory the kernel reads: not zero, it updates
// nothing (the step's device verdict).
void cuda_adam_update_runs(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                           const std::vector<FlatRun>& runs, void* stream, const float* skip_if = nullptr);
void cuda_sgd_update_runs(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                          const std::vector<FlatRun>& runs, void* stream, const float* skip_if = nullptr);

// One run: `param_copy` (and, without momentum, `momentum_buffer`) may be
// undefined (default-constructed) tensors.
void cuda_adam_update(const AdamOptions& options, int64_t step, double grad_scale,
                      const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                      const Tensor& exp_avg_sq, const Tensor& param_copy, void* stream);
void cuda_sgd_update(const SgdOptions& options, int64_t step, double grad_scale, const Tensor& param,
                     const Tensor& grad, const Tensor& momentum_buffer, const Tensor& param_copy,
                     void* stream);

}  // namespace zerocore
