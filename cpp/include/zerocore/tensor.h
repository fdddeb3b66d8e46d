// The opaque tensor that crosses the API: a contiguous block of elements on
// a device, with a shared owner that keeps the memory alive. Views share
// their parent's owner, so memory is freed when the last holder lets go,
// whether that holder is C++, Python or torch (through DLPack).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zerocore/dtype.h"

namespace zerocore {

class Backend;
enum class MemoryKind : uint8_t;

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, DType dtype, Device device, std::vector<int64_t> shape,
         std::shared_ptr<void> owner);

  // A new host tensor with its own memory (from a HostArena).
  static Tensor empty(std::vector<int64_t> shape, DType dtype);
  // The same in a buffer of its own from `backend`, memory of `kind`, named
  // `name` in the checker's reports (backend/backend.h).
  static Tensor empty(std::vector<int64_t> shape, DType dtype, Backend& backend, MemoryKind kind,
                      const std::string& name);
  // The same, reading as zeros; large ones hold no resident memory until
  // written (HostArena::create).
  static Tensor zeros(std::vector<int64_t> shape, DType dtype);

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return size_t(numel_) * dtype_size(dtype_); }
  const std::shared_ptr<void>& owner() const { return owner_; }

  // A contiguous view of `count` elements starting at element `offset`,
  // sharing this tensor's owner.
  Tensor slice(int64_t offset, int64_t count) const;

  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  Device device_{};
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  std::shared_ptr<void> owner_;
};

}  // namespace zerocore
