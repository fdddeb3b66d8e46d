// Element types and devices of zerocore tensors.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zerocore {

enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16 };

constexpr size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType t);  // "float32", "float16", "bfloat16"

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

}  // namespace zerocore
