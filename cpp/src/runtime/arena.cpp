#include "zerocore/runtime/arena.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

namespace {
std::atomic<size_t> g_live_bytes{0};
std::atomic<uint64_t> g_created{0};
constexpr size_t kSmallAlign = 64;  // a cache line; enough for any SIMD load

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }
}  // namespace

std::shared_ptr<HostArena> HostArena::create(size_t bytes, bool zeroed) {
  return std::shared_ptr<HostArena>(new HostArena(bytes, zeroed));
}

HostArena::HostArena(size_t bytes, bool zeroed) : bytes_(bytes) {
  if (bytes >= kHugePageBytes) {
    // mmap gives page-aligned zeroed memory. The start is 2 MiB aligned so
    // every whole 2 MiB stretch can be a huge page; the tail stays in 4 KiB
    // pages rather than rounding the arena up (up to 2 MiB wasted each).
    mapped_bytes_ = round_up(bytes, 4096);
    void* p = mmap(nullptr, mapped_bytes_ + kHugePageBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    // Trim to a 2 MiB aligned start: transparent huge pages need it.
    char* raw = static_cast<char*>(p);
    char* aligned = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(raw), kHugePageBytes));
    if (aligned > raw) munmap(raw, size_t(aligned - raw));
    const size_t tail = size_t(raw + mapped_bytes_ + kHugePageBytes - (aligned + mapped_bytes_));
    if (tail) munmap(aligned + mapped_bytes_, tail);
    data_ = aligned;
#ifdef MADV_HUGEPAGE
    huge_pages_ = madvise(data_, mapped_bytes_, MADV_HUGEPAGE) == 0;
#endif
  } else {
    const size_t rounded = round_up(bytes ? bytes : 1, kSmallAlign);
    data_ = std::aligned_alloc(kSmallAlign, rounded);
    if (!data_) throw std::bad_alloc();
    if (zeroed) std::memset(data_, 0, rounded);
  }
  g_live_bytes += bytes_;
  ++g_created;
}

HostArena::~HostArena() {
  if (mapped_bytes_) {
    munmap(data_, mapped_bytes_);
  } else {
    std::free(data_);
  }
  g_live_bytes -= bytes_;
}

Tensor HostArena::view(size_t byte_offset, DType dtype, std::vector<int64_t> shape) const {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d < 0 ? 0 : d;
  const size_t need = size_t(numel) * dtype_size(dtype);
  if (byte_offset % dtype_size(dtype) != 0) {
    throw InvalidArgument("arena view at byte " + std::to_string(byte_offset) + " is not aligned for " +
                          dtype_name(dtype));
  }
  if (byte_offset > bytes_ || need > bytes_ - byte_offset) {
    throw InvalidArgument("arena view of " + std::to_string(need) + " bytes at " +
                          std::to_string(byte_offset) + " overruns an arena of " + std::to_string(bytes_));
  }
  std::shared_ptr<const HostArena> self = shared_from_this();
  return Tensor(static_cast<char*>(data_) + byte_offset, dtype, Device{}, std::move(shape),
                std::const_pointer_cast<HostArena>(self));
}

size_t HostArena::live_bytes() { return g_live_bytes.load(); }

uint64_t HostArena::created() { return g_created.load(); }

}  // namespace zerocore
