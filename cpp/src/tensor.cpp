#include "zerocore/tensor.h"

#include <string>

#include "zerocore/runtime/arena.h"
#include "zerocore/backend/backend.h"
#include "zerocore/error.h"

namespace zerocore {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt64: return "int64";
    case DType::kInt40: return "int40";
  }
  return "unknown";
}

static int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw InvalidArgument("tensor shape has a negative dimension");
    n *= d;
  }
  return n;
}

Tensor::Tensor(void* data, DType dtype, Device device, std::vector<int64_t> shape,
               std::shared_ptr<void> owner)
    : data_(data),
      dtype_(dtype),
      device_(device),
      shape_(std::move(shape)),
      numel_(checked_numel(shape_)),
      owner_(std::move(owner)) {}

namespace {
Tensor in_arena(std::vector<int64_t> shape, DType dtype, bool zeroed) {
  const int64_t n = checked_numel(shape);
  auto arena = HostArena::create(size_t(n) * dtype_size(dtype), zeroed);
  return arena->view(0, dtype, std::move(shape));
}
}  // namespace

Tensor Tensor::empty(std::vector<int64_t> shape, DType dtype) { return in_arena(std::move(shape), dtype, false); }

Tensor Tensor::empty(std::vector<int64_t> shape, DType dtype, Backend& backend, MemoryKind kind,
                     const std::string& name) {
  const size_t bytes = size_t(checked_numel(shape)) * dtype_size(dtype);
  return backend.allocate(kind, bytes, name)->view(0, dtype, std::move(shape));
}

Tensor Tensor::zeros(std::vector<int64_t> shape, DType dtype) { return in_arena(std::move(shape), dtype, true); }

Tensor Tensor::slice(int64_t offset, int64_t count) const {
  if (offset < 0 || count < 0 || offset + count > numel_) {
    throw InvalidArgument("slice [" + std::to_string(offset) + ", " + std::to_string(offset + count) +
                          ") is outside a tensor of " + std::to_string(numel_) + " elements");
  }
  char* base = static_cast<char*>(data_) + size_t(offset) * dtype_size(dtype_);
  return Tensor(base, dtype_, device_, {count}, owner_);
}

}  // namespace zerocore
