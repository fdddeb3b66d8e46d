// Internal: arithmetic on CRC-32C registers, the polynomial of both paths,
// and the SSE4.2 path's combining of its streams. A register holds a polynomial over GF(2) modulo P (degree
// 32), reflected: bit 31 is the coefficient of x^0, bit 0 that of x^31.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zerocore::crc32c_math {

constexpr uint32_t kPoly = 0x82F63B78u;  // P without its x^32 term, reflected

// a * b mod P.
constexpr uint32_t multiply(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return product;
}

// x^(8 * bytes) mod P: what a register is multiplied by when `bytes` zero
// bytes pass through it.
constexpr uint32_t x_to_the_8n(size_t bytes) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 23;   // x^8, squared at each bit of `bytes`
  for (; bytes; bytes >>= 1) {
    if (bytes & 1) result = multiply(result, power);
    power = multiply(power, power);
  }
  return result;
}

}  // namespace zerocore::crc32c_math
