// Element types and devices of zerocore tensors.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zerocore {

// kInt64: Config(deterministic=True)'s exact grad sums (python/zerocore/
// state/exact_grads.py), which gradient reduction stages, reduce-scatters and adds
// as integers; the float kernels refuse it.
enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kInt64 };

constexpr size_t dtype_size(DType t) { return t == DType::kInt64 ? 8 : t == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType t);  // "float32", "float16", "bfloat16", "int64"

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

}  // namespace zerocore
