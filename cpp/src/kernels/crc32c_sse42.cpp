// The SSE4.2 path of crc32c (compiled with -msse4.2, run only where the CPU
// has it: crc32c.cpp). The crc32 instruction takes 3 cycles and can start one
// a cycle, so three independent streams over three stretches of a block keep
// it busy; their registers are then combined: a register that has seen A
// continues over B as (register shifted over |B| zero bytes) xor (a zero
// register over B), the CRC being linear.
#include <nmmintrin.h>

#include <cstring>

#include "crc32c_math.h"

namespace zerocore {

namespace {

constexpr size_t kStretch = 4096;  // bytes of each stream a block: long enough that the combine is rare
constexpr uint32_t kShiftOne = crc32c_math::x_to_the_8n(kStretch);
constexpr uint32_t kShiftTwo = crc32c_math::x_to_the_8n(2 * kStretch);

inline uint64_t load(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

uint32_t crc32c_sse42_register(const uint8_t* p, size_t n, uint32_t reg) {
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7); ++p, --n) reg = _mm_crc32_u8(reg, *p);
  for (; n >= 3 * kStretch; p += 3 * kStretch, n -= 3 * kStretch) {
    uint64_t a = reg, b = 0, c = 0;
    for (size_t i = 0; i < kStretch; i += 8) {
      a = _mm_crc32_u64(a, load(p + i));
      b = _mm_crc32_u64(b, load(p + kStretch + i));
      c = _mm_crc32_u64(c, load(p + 2 * kStretch + i));
    }
    reg = crc32c_math::multiply(kShiftTwo, uint32_t(a)) ^ crc32c_math::multiply(kShiftOne, uint32_t(b)) ^
          uint32_t(c);
  }
  uint64_t r = reg;
  for (; n >= 8; p += 8, n -= 8) r = _mm_crc32_u64(r, load(p));
  reg = uint32_t(r);
  for (; n; ++p, --n) reg = _mm_crc32_u8(reg, *p);
  return reg;
}

}  // namespace zerocore
