// The AVX-512 path, built with -mavx512f (plus FMA/F16C for the scalar
// tail); taken only on CPUs and OSes that enable AVX-512 state.
//
// fp16 uses the AVX-512 conversion instructions. bf16 is rounded with
// integer operations rather than VCVTNEPS2BF16: that instruction flushes
// subnormals to zero, which would make this path disagree with torch and
// with the other paths, and in this memory-bound pass the few extra integer
// operations cost nothing measurable.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"
#include "zerocore/half.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore::cpu {
namespace avx512_isa {
#include "cpu_vec_scalar.h"

struct Avx512Vec {
  static constexpr int width = 16;
  using reg = __m512;
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg load_bf16(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static reg load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_bf16(uint16_t* p, reg x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_fp16(uint16_t* p, reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
};

#include "cpu_kernels_impl.h"
}  // namespace avx512_isa

const KernelTable& avx512_kernels() { return avx512_isa::kernel_table<avx512_isa::Avx512Vec>(); }

}  // namespace zerocore::cpu
