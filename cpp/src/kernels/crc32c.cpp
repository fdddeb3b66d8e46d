#include "zerocore/kernels/crc32c.h"

#include <array>
#include <cstring>

#include "crc32c_math.h"

namespace zerocore {

#if defined(__x86_64__) || defined(_M_X64)
uint32_t crc32c_sse42_register(const uint8_t* p, size_t n, uint32_t reg);  // crc32c_sse42.cpp
#endif

namespace {

using Tables = std::array<std::array<uint32_t, 256>, 8>;

// tables[0][b]: the register after byte b passes through a zero register;
// tables[k][b]: the same followed by k zero bytes, so that eight bytes fold
// in with eight lookups.
constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int bit = 0; bit < 8; ++bit) r = (r & 1) ? (r >> 1) ^ crc32c_math::kPoly : r >> 1;
    t[0][b] = r;
  }
  for (size_t k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
  return t;
}

constexpr Tables kTables = make_tables();

uint32_t portable_register(const uint8_t* p, size_t n, uint32_t reg) {
  const Tables& t = kTables;
  for (; n >= 8; p += 8, n -= 8) {  // bytes read one by one: the same on any byte order
    const uint32_t lo = reg ^ (uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24);
    reg = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
          t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
  }
  for (; n; ++p, --n) reg = (reg >> 8) ^ t[0][(reg ^ *p) & 0xFF];
  return reg;
}

bool sse42() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool supported = __builtin_cpu_supports("sse4.2");
  return supported;
#else
  return false;
#endif
}

}  // namespace

// The register starts at all ones and ends inverted; a CRC continued from
// `crc` restarts from its register, ~crc.
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc) {
  return ~portable_register(static_cast<const uint8_t*>(data), bytes, ~crc);
}

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
#if defined(__x86_64__) || defined(_M_X64)
  if (sse42()) return ~crc32c_sse42_register(static_cast<const uint8_t*>(data), bytes, ~crc);
#endif
  return crc32c_portable(data, bytes, crc);
}

uint32_t copy_crc32c(void* dst, const void* src, size_t bytes, uint32_t crc) {
  constexpr size_t kBlock = 16384;  // well inside L1 and L2: the checksum reads what the copy just wrote
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t done = 0; done < bytes; done += kBlock) {
    const size_t n = bytes - done < kBlock ? bytes - done : kBlock;
    std::memcpy(d + done, s + done, n);
    crc = crc32c(d + done, n, crc);
  }
  return crc;
}

bool crc32c_in_hardware() { return sse42(); }

}  // namespace zerocore
