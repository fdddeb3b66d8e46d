#include "zerocore/backend/memory.h"

#include <string>

#include "zerocore/error.h"

namespace zerocore {

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHostPageable: return "host pageable";
    case MemoryKind::kHostPinned: return "host pinned";
    case MemoryKind::kDevice: return "device";
  }
  return "unknown";
}

Buffer::Buffer(MemoryKind kind, Device device, std::string name, void* data, size_t bytes,
               std::shared_ptr<void> storage)
    : kind_(kind), device_(device), name_(std::move(name)), data_(data), bytes_(bytes), storage_(std::move(storage)) {}

Tensor Buffer::view(size_t byte_offset, DType dtype, std::vector<int64_t> shape) const {
  const size_t size = dtype_size(dtype);
  if (byte_offset % size != 0) {
    throw InvalidArgument("view of buffer '" + name_ + "' at byte " + std::to_string(byte_offset) +
                          " is not aligned for " + dtype_name(dtype));
  }
  std::shared_ptr<void> owner = std::const_pointer_cast<Buffer>(shared_from_this());
  Tensor shaped(static_cast<char*>(data_) + byte_offset, dtype, device_, std::move(shape), owner);
  // slice() of the whole buffer checks that the view fits.
  Tensor(data_, dtype, device_, {int64_t(bytes_ / size)}, owner).slice(int64_t(byte_offset / size), shaped.numel());
  return shaped;
}

}  // namespace zerocore
