#include "zerocore/kernels/cpu_accumulate.h"

#include <cmath>
#include <string>

#include "zerocore/error.h"
#include "zerocore/half.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore {

namespace {
#include "cpu_vec_scalar.h"
}  // namespace

void accumulate(const Tensor& dst, const Tensor& src) {
  if (dst.device().type != DeviceType::kCPU || src.device().type != DeviceType::kCPU) {
    throw TypeMismatch("accumulate: tensors must be on the host");
  }
  if (dst.numel() != src.numel()) {
    throw InvalidArgument("accumulate: " + std::to_string(src.numel()) + " elements into " +
                          std::to_string(dst.numel()));
  }
  const int64_t n = dst.numel();
  if (dst.dtype() == DType::kInt40) {  // a partition's exact sums: int64 shards into 40-bit sums
    if (src.dtype() != DType::kInt64) throw TypeMismatch("accumulate: int40 sums take int64 elements only");
    uint8_t* d = static_cast<uint8_t*>(dst.data());
    const int64_t* s = static_cast<const int64_t*>(src.data());
    for (int64_t i = 0; i < n; ++i) kernels::add_to_int40(d + 5 * i, s[i]);
    return;
  }
  if (dst.dtype() == DType::kInt64 || src.dtype() == DType::kInt64) {  // exact sums: integers into integers
    if (dst.dtype() != src.dtype()) throw TypeMismatch("accumulate: int64 sums take int64 elements only");
    int64_t* d = static_cast<int64_t*>(dst.data());
    const int64_t* s = static_cast<const int64_t*>(src.data());
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
    return;
  }
  kernels::with_element_type(dst.dtype(), [&](auto d_type) {
    kernels::with_element_type(src.dtype(), [&](auto s_type) {
      using D = decltype(d_type);
      using S = decltype(s_type);
      D* d = static_cast<D*>(dst.data());
      const S* s = static_cast<const S*>(src.data());
      // Inlined scalar ops: the compiler vectorises the fp32 loop.
      for (int64_t i = 0; i < n; ++i) kernels::accumulate_at<ScalarVec>(d, s, i);
    });
  });
}

}  // namespace zerocore
