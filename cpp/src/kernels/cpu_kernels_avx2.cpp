// The AVX2 path, built with -mavx2 -mfma -mf16c; taken only on CPUs that
// report all three.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"
#include "zerocore/half.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore::cpu {
namespace avx2_isa {
#include "cpu_vec_scalar.h"

struct Avx2Vec {
  static constexpr int width = 8;
  using reg = __m256;
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg load_bf16(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static reg load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_bf16(uint16_t* p, reg x) {
    // Round to nearest even on the integer bits (as float_to_bf16), keep
    // NaNs quiet, then pack the eight 16-bit results.
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    // Pack the two 128-bit halves directly: no cross-lane permute.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_fp16(uint16_t* p, reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
};

#include "cpu_kernels_impl.h"
}  // namespace avx2_isa

const KernelTable& avx2_kernels() { return avx2_isa::kernel_table<avx2_isa::Avx2Vec>(); }

}  // namespace zerocore::cpu
