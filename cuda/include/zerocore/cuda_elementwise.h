// Accumulate-and-cast and fill on CUDA tensors: the GPU twins of
// kernels/cpu_accumulate.h and kernels/cpu_fill.h, rounding bit for bit as
// they do (both instantiate kernels/element_math.h). Queued on `stream` (a
// cudaStream_t; nullptr is the legacy default stream); the call returns once
// the work is launched. Needs no CUDA headers.
#pragma once
#include "zerocore/tensor.h"

namespace zerocore {

// dst += src, elementwise, added in float and rounded once to dst's dtype;
// any dtypes, the same number of elements, one CUDA device. Throws
// TypeMismatch (device) or InvalidArgument (sizes) before launching.
void cuda_accumulate(const Tensor& dst, const Tensor& src, void* stream);

// dst (int64) += src * 2**-exponent rounded to an integer, ties to even,
// and largest (one fp32 element) = the largest of itself and every |src|,
// ordered by their bits, as kernels/cpu_exact_grid.h's accumulate_on_grid
// (0 added where not finite or beyond int64: the step is skipped there);
// src fp32, bf16 or fp16, all on one CUDA device.
void cuda_accumulate_on_grid(const Tensor& dst, const Tensor& src, int exponent, const Tensor& largest,
                             void* stream);

// Every element of dst (a CUDA tensor) set to `value` rounded to its dtype.
void cuda_fill(const Tensor& dst, float value, void* stream);

}  // namespace zerocore
