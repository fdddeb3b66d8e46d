// dst[i] = value on a flat host tensor of any of the runtime's dtypes,
// rounded once to a 16-bit dtype as torch's fill_ does: zeroing grads and
// staging, and the NaN the checking backend writes into released buffers.
#pragma once
#include "zerocore/tensor.h"

namespace zerocore {

// Throws TypeMismatch for a device tensor.
void fill(const Tensor& dst, float value);

}  // namespace zerocore
