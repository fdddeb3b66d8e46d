// Reductions over flat host tensors.
#pragma once
#include <vector>

#include "zerocore/tensor.h"

namespace zerocore {

// The sum of the squares of every element of `xs` (fp32, bf16 or fp16, on
// the host), accumulated in fp64: the squared global gradient norm of a
// partition in one pass, with no fp32 copy of 16-bit grads. It is finite
// exactly when every element is (any inf or NaN makes it inf or NaN), so
// it is also the overflow check. For a given thread count the result is
// the same bits on every call. Throws TypeMismatch for another dtype or a
// device tensor.
double sum_of_squares(const std::vector<Tensor>& xs);
// The same into a mailbox's two slots: *sum, and *finite = 1 when it is
// finite (every element is), else 0: what a backend's host kernel writes.
void sum_of_squares_into(const std::vector<Tensor>& xs, double* sum, double* finite);
// counter (one fp32 element on the host) += 1 when some element of xs is
// not finite: a backend's host kernel of the step's device verdict.
void count_nonfinite_into(const std::vector<Tensor>& xs, const Tensor& counter);
// Whether an update given `skip_if` (one fp32 element on the host, or an
// empty Tensor: never) skips: the element is not zero.
bool skipped(const Tensor& skip_if);

}  // namespace zerocore
