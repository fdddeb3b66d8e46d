// The scalar 16-bit conversions (the reference for every SIMD path):
// exhaustive round trips, rounding ties, and specials.
#include <cmath>
#include <cstdint>

#include "check.h"
#include "zerocore/half.h"

using namespace zerocore;

int main() {
  // Every finite 16-bit value survives a round trip through float.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = fp16_to_float(uint16_t(h));
    if (std::isnan(f)) {
      CHECK((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0);
      CHECK(std::isnan(fp16_to_float(float_to_fp16(f))));
    } else {
      CHECK(float_to_fp16(f) == h);
    }
    const float b = bf16_to_float(uint16_t(h));
    if (!std::isnan(b)) CHECK(float_to_bf16(b) == h);
  }
  // Ties round to even; just above a tie rounds up.
  CHECK(float_to_bf16(bits_float(0x3f808000u)) == 0x3f80u);  // 1 + 2^-8: tie, even stays
  CHECK(float_to_bf16(bits_float(0x3f818000u)) == 0x3f82u);  // tie, odd rounds up
  CHECK(float_to_bf16(bits_float(0x3f808001u)) == 0x3f81u);
  CHECK(float_to_fp16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00u);
  CHECK(float_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02u);
  // Overflow, underflow, subnormals.
  CHECK(float_to_fp16(65504.0f) == 0x7bffu);
  CHECK(float_to_fp16(65519.0f) == 0x7bffu);
  CHECK(float_to_fp16(65520.0f) == 0x7c00u);
  CHECK(float_to_fp16(-1e10f) == 0xfc00u);
  CHECK(float_to_fp16(std::ldexp(1.0f, -24)) == 0x0001u);   // smallest subnormal
  CHECK(float_to_fp16(std::ldexp(1.0f, -25)) == 0x0000u);   // tie with zero: even
  CHECK(float_to_fp16(std::ldexp(1.5f, -25)) == 0x0001u);
  CHECK(float_to_bf16(INFINITY) == 0x7f80u && float_to_bf16(-INFINITY) == 0xff80u);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  CHECK(float_to_bf16(bits_float(0x7f7fffffu)) == 0x7f80u);  // max float rounds to inf
  return test::finish("test_half");
}
