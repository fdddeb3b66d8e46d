// Host arenas: each long-lived buffer kind (params, grads, optimizer state,
// pinned staging) is one allocation made once from the layout plan; tensors
// are views into it (ZeRO-R's memory defragmentation). Large arenas ask the
// OS for transparent huge pages, which cuts TLB misses in bandwidth-bound
// passes such as the CPU Adam update.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "zerocore/tensor.h"

namespace zerocore {

class HostArena : public std::enable_shared_from_this<HostArena> {
 public:
  // Arenas of at least this many bytes are 2 MiB aligned and madvise'd for
  // huge pages.
  static constexpr size_t kHugePageBytes = size_t(2) << 20;

  // zeroed: the memory reads as zeros. A large arena's pages come zeroed
  // from the OS and stay unbacked until first written, so zeroed state
  // (optimizer moments, grads, buffers) costs no resident memory until used.
  static std::shared_ptr<HostArena> create(size_t bytes, bool zeroed = false);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // True when the OS accepted the huge-page advice for this arena.
  bool huge_pages() const { return huge_pages_; }

  // A view of `shape` elements of `dtype` at `byte_offset`; the view keeps
  // the arena alive. Throws InvalidArgument if it does not fit or is
  // misaligned for the dtype.
  Tensor view(size_t byte_offset, DType dtype, std::vector<int64_t> shape) const;

  // Bytes held by all live arenas of this process (for leak tests and
  // memory reports).
  static size_t live_bytes();
  // Arenas this process has created so far (a count that only grows): what
  // shows that a loop, such as a training step, allocates nothing.
  static uint64_t created();

 private:
  HostArena(size_t bytes, bool zeroed);
  void* data_ = nullptr;
  size_t bytes_ = 0;
  size_t mapped_bytes_ = 0;  // non-zero when the memory came from mmap
  bool huge_pages_ = false;
};

}  // namespace zerocore
