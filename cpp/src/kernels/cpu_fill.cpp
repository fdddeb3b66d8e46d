#include "zerocore/kernels/cpu_fill.h"

#include <algorithm>

#include "zerocore/error.h"
#include "zerocore/half.h"

namespace zerocore {

void fill(const Tensor& dst, float value) {
  if (dst.device().type != DeviceType::kCPU) throw TypeMismatch("fill: the tensor must be on the host");
  switch (dst.dtype()) {
    case DType::kFloat32:
      std::fill_n(dst.data_as<float>(), dst.numel(), value);
      break;
    case DType::kBFloat16:
      std::fill_n(dst.data_as<uint16_t>(), dst.numel(), float_to_bf16(value));
      break;
    case DType::kFloat16:
      std::fill_n(dst.data_as<uint16_t>(), dst.numel(), float_to_fp16(value));
      break;
  }
}

}  // namespace zerocore
