// Optimizers on flat fp32 partitions, on a CUDA device: the GPU twin of
// cpu_optim.h, with the same semantics (torch.optim's Adam/AdamW, gradient
// multiplied by `grad_scale`, optional bf16/fp16 param copy written in the
// same pass) and the same rounding: for the same inputs, cuda_adam_update
// and adam_update give bit-identical params, state and copy. Kernels are queued on `stream` (a cudaStream_t; nullptr is the
// legacy default stream) and run asynchronously: the call returns once the
// work is launched. This header needs no CUDA headers, so a C++ trainer can
// include it without nvcc.
#pragma once
#include <cstdint>
#include <string>

#include "zerocore/kernels/cpu_optim.h"  // AdamOptions
#include "zerocore/tensor.h"

namespace zerocore {

// Number of CUDA devices this process can use. Returns 0, never throws, when
// there is no driver, no device, or the driver is too old for the runtime.
int cuda_device_count();

// Why no device can be used, in CUDA's words (e.g. "cudaErrorInsufficientDriver:
// CUDA driver version is insufficient for CUDA runtime version"); empty when
// cuda_device_count() > 0. Never throws.
std::string cuda_unavailable_reason();

// Every tensor must be on the same CUDA device (param's); `param_copy` may be
// an undefined (default-constructed) tensor. `step` counts from 1. Throws
// InvalidArgument / TypeMismatch on a bad argument before launching anything,
// and InvalidArgument or std::runtime_error (with CUDA's message) when a CUDA
// call fails.
void cuda_adam_update(const AdamOptions& options, int64_t step, double grad_scale,
                      const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                      const Tensor& exp_avg_sq, const Tensor& param_copy, void* stream);

}  // namespace zerocore
