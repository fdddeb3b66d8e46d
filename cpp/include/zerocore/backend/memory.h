// Memory kinds and the buffers a backend allocates. A Buffer is one
// allocation made once (an arena, as HostArena is on the host); the runtime
// works on tensor views of it. The checking backend knows every buffer by
// its address range and name, so an access names the buffer it touched.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zerocore/tensor.h"

namespace zerocore {

// Where a buffer lives. On CUDA: pageable host memory (malloc), pinned host
// memory (cudaHostAlloc; what async copies to and from the device need) and
// device memory (cudaMalloc). The CPU backends give all three as host
// arenas and keep the kind for what they check and report.
enum class MemoryKind : uint8_t { kHostPageable, kHostPinned, kDevice };

const char* memory_kind_name(MemoryKind kind);  // "host pageable", "host pinned", "device"

class Buffer : public std::enable_shared_from_this<Buffer> {
 public:
  // `storage` owns the memory at `data`; the buffer frees it by letting go.
  Buffer(MemoryKind kind, Device device, std::string name, void* data, size_t bytes, std::shared_ptr<void> storage);
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  MemoryKind kind() const { return kind_; }
  Device device() const { return device_; }
  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

  // A view of `shape` elements of `dtype` at `byte_offset`, keeping the
  // buffer alive. Throws InvalidArgument if it overruns the buffer or is
  // misaligned for the dtype.
  Tensor view(size_t byte_offset, DType dtype, std::vector<int64_t> shape) const;

 private:
  MemoryKind kind_;
  Device device_;
  std::string name_;
  void* data_;
  size_t bytes_;
  std::shared_ptr<void> storage_;
};

}  // namespace zerocore
