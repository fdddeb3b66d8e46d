// Element types and devices of zerocore tensors.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zerocore {

// kInt64: Config(deterministic=True)'s exact grad sums (python/zerocore/
// state/exact_grads.py), which gradient reduction stages, reduce-scatters and adds
// as integers; the float kernels refuse it. kInt40: the sums a grad
// partition keeps across a step's micro-batches, 40-bit two's complement
// in 5 bytes, little-endian, packed (no alignment: the grid keeps every
// sum below 2**39, so 5 bytes hold it where int64 would take 8); only
// int64 is added into it (accumulate) and it is only zeroed (fill with 0).
enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kInt64, kInt40 };

constexpr size_t dtype_size(DType t) {
  return t == DType::kInt64 ? 8 : t == DType::kInt40 ? 5 : t == DType::kFloat32 ? 4 : 2;
}
const char* dtype_name(DType t);  // "float32", "float16", "bfloat16", "int64", "int40"

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

}  // namespace zerocore
