#include "zerocore/kernels/cpu_accumulate.h"

#include <string>

#include "zerocore/error.h"
#include "zerocore/half.h"

namespace zerocore {

namespace {

template <class Load, class Store>
void add_loop(int64_t n, Load load_dst, Load load_src, Store store) {
  for (int64_t i = 0; i < n; ++i) store(i, load_dst(i) + load_src(i));
}

// A reader of element i as float, for each dtype.
struct Reader {
  const void* p;
  DType dtype;
  float operator()(int64_t i) const {
    switch (dtype) {
      case DType::kFloat32: return static_cast<const float*>(p)[i];
      case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
      case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    }
    return 0.0f;
  }
};

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
  if (dst.dtype() == DType::kFloat32 && src.dtype() == DType::kFloat32) {
    float* d = dst.data_as<float>();
    const float* s = src.data_as<float>();
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];  // the common case, vectorised by the compiler
    return;
  }
  const Reader d{dst.data(), dst.dtype()}, s{src.data(), src.dtype()};
  switch (dst.dtype()) {
    case DType::kFloat32:
      add_loop(n, d, s, [p = dst.data_as<float>()](int64_t i, float x) { p[i] = x; });
      break;
    case DType::kBFloat16:
      add_loop(n, d, s, [p = dst.data_as<uint16_t>()](int64_t i, float x) { p[i] = float_to_bf16(x); });
      break;
    case DType::kFloat16:
      add_loop(n, d, s, [p = dst.data_as<uint16_t>()](int64_t i, float x) { p[i] = float_to_fp16(x); });
      break;
  }
}

}  // namespace zerocore
