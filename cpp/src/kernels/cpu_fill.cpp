#include "zerocore/kernels/cpu_fill.h"

#include <algorithm>
#include <cmath>

#include "zerocore/error.h"
#include "zerocore/half.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore {

namespace {
#include "cpu_vec_scalar.h"
}  // namespace

void fill(const Tensor& dst, float value) {
  if (dst.device().type != DeviceType::kCPU) throw TypeMismatch("fill: the tensor must be on the host");
  if (dst.dtype() == DType::kInt64) {  // exact sums: integers
    std::fill_n(static_cast<int64_t*>(dst.data()), dst.numel(), int64_t(value));
    return;
  }
  if (dst.dtype() == DType::kInt40) {  // a partition's exact sums: zeroed only
    if (value != 0.0f) throw InvalidArgument("fill: int40 sums are only zeroed");
    std::fill_n(static_cast<uint8_t*>(dst.data()), 5 * dst.numel(), uint8_t(0));
    return;
  }
  kernels::with_element_type(dst.dtype(), [&](auto d_type) {
    using D = decltype(d_type);
    D* d = static_cast<D*>(dst.data());
    for (int64_t i = 0, n = dst.numel(); i < n; ++i) kernels::fill_at<ScalarVec>(d, value, i);
  });
}

}  // namespace zerocore
