// dst += src on flat host tensors of any of the runtime's dtypes: how the
// gradient reduction adds a param's grad into its staging bucket and a
// reduced shard into the rank's grad partition. 16-bit sums are computed in
// fp32 and rounded once, as torch's add_ does.
#pragma once
#include "zerocore/tensor.h"

namespace zerocore {

// Throws InvalidArgument when the sizes differ and TypeMismatch for a device tensor.
void accumulate(const Tensor& dst, const Tensor& src);

}  // namespace zerocore
