// The sum of squares with a finiteness flag on CUDA tensors: the GPU twin of
// kernels/cpu_reduce.h (the squared gradient norm and the overflow check of
// a step), in one launch over every tensor. Each square and addition is
// kernels/element_math.h's add_square, in float64, as on the CPU; only the
// order of the additions differs (a fixed tree, the same bits on every call
// on one device), so the two agree to float64 rounding, not bit for bit, as
// the CPU's own result depends on its thread count. Needs no CUDA headers.
#pragma once
#include <vector>

#include "zerocore/tensor.h"

namespace zerocore {

// *sum = the sum of the squares of every element of `xs` (fp32, bf16 or
// fp16, all on CUDA device `device`); *finite = 1.0 when every element is
// finite, else 0.0. The kernel writes `sum` and `finite` directly when it
// can (device memory of `device`, pinned host memory: a mailbox); pageable
// host memory (a mailbox whose pinning failed) gets them by a copy from
// device memory, which blocks the host until the kernel is done. Queued on
// `stream` (a cudaStream_t); returns once launched. Throws TypeMismatch for a tensor
// on another device before launching. Per (device, stream) it keeps a
// scratch of a few KiB, allocated on the first call and kept for the
// process, so calls on one stream never share it with another's.
void cuda_sum_of_squares(const std::vector<Tensor>& xs, int device, double* sum, double* finite, void* stream);
// counter (one fp32 element on `device`) += 1 when some element of xs is
// not finite, in the same pass: the step's verdict on the device.
void cuda_count_nonfinite(const std::vector<Tensor>& xs, int device, const Tensor& counter, void* stream);

}  // namespace zerocore
