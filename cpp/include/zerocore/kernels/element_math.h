// The per-element math of every kernel, written once: Adam/AdamW, SGD
// (momentum, dampening, nesterov, L2 decay) with the optional 16-bit param
// copy, accumulate-and-cast, fill, and the float64 sum-of-squares step.
//
// Each function is a template over an ops trait V: `reg` (a float, or a
// SIMD register / pack of floats), `set1`, loads and stores of float, bf16
// and fp16 with round-to-nearest-even, `add`, `mul`, `div`, `sqrt`, `fma`
// (one rounding) and the float64 `add_f64` / `mul_f64`. The CPU kernels
// instantiate them with their scalar and SIMD traits (cpu_vec_scalar.h,
// cpu_kernels_<isa>.cpp), the CUDA kernels with theirs (cuda/src/
// cuda_ops.cuh, spelled with the _rn intrinsics nvcc never contracts), so
// every path performs the same IEEE operations in the same order and the CPU
// tests check the arithmetic the GPU runs.
//
// The functions are host-and-device under nvcc; in a host-only build the
// marker is plain `inline`, so this header needs no CUDA.
#pragma once
#include <cstdint>

#include "zerocore/dtype.h"
#include "zerocore/error.h"
#include "zerocore/kernels/optim.h"

#if defined(__CUDACC__)
#define ZC_HD __host__ __device__ __forceinline__
#else
#define ZC_HD inline
#endif

namespace zerocore::kernels {

// Element types of the 16-bit arrays, and "no param copy" (its store
// compiles away).
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};
struct NoCopy {};

// Calls f(T{}) with T the element type of `dtype`: float, Bf16 or Fp16;
// the exact grad sums' integers (int64, int40) have no float kernel.
template <class F>
inline void with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kBFloat16: f(Bf16{}); break;
    case DType::kFloat16: f(Fp16{}); break;
    case DType::kInt64:
    case DType::kInt40: throw TypeMismatch("a float kernel was given integer elements (exact grad sums)");
  }
}

// *p += x for a 40-bit two's complement integer packed in 5 little-endian
// bytes (DType::kInt40): exact while the sum stays in [-2**39, 2**39),
// which the grid guarantees or the step is skipped (exact_grads.py);
// past it the sum wraps. Byte loads: a packed element has no alignment.
ZC_HD void add_to_int40(uint8_t* p, int64_t x) {
  uint64_t v = 0;
  for (int b = 0; b < 5; ++b) v |= uint64_t(p[b]) << (8 * b);
  v += uint64_t(x);  // modulo 2**64, of which the low 40 bits are the sum's
  for (int b = 0; b < 5; ++b) p[b] = uint8_t(v >> (8 * b));
}

// The int40 at p, sign-extended.
ZC_HD int64_t load_int40(const uint8_t* p) {
  uint64_t v = 0;
  for (int b = 0; b < 5; ++b) v |= uint64_t(p[b]) << (8 * b);
  return int64_t(v << 24) >> 24;  // arithmetic shift (C++20's rule, and every compiler's before it)
}

template <class V>
ZC_HD typename V::reg load(const float* p) {
  return V::load_f32(p);
}
template <class V>
ZC_HD typename V::reg load(const Bf16* p) {
  return V::load_bf16(&p->bits);
}
template <class V>
ZC_HD typename V::reg load(const Fp16* p) {
  return V::load_fp16(&p->bits);
}
template <class V>
ZC_HD void store(float* p, typename V::reg x) {
  V::store_f32(p, x);
}
template <class V>
ZC_HD void store(Bf16* p, typename V::reg x) {
  V::store_bf16(&p->bits, x);
}
template <class V>
ZC_HD void store(Fp16* p, typename V::reg x) {
  V::store_fp16(&p->bits, x);
}
template <class V>
ZC_HD void store(NoCopy*, typename V::reg) {}

// torch.optim's Adam/AdamW at element(s) i: eps outside the square root,
// bias corrections folded into the coefficients. The decay terms are
// skipped on their values, so a zero decay never turns 0 * inf into NaN.
template <class V, class G, class C>
ZC_HD void adam_at(const AdamCoefs& c, float* p, const G* g, float* m, float* v, C* copy, int64_t i) {
  using R = typename V::reg;
  R grad = V::mul(load<V>(g + i), V::set1(c.grad_scale));
  R param = V::load_f32(p + i);
  if (c.l2_decay != 0.0f) grad = V::fma(V::set1(c.l2_decay), param, grad);
  if (c.param_decay != 1.0f) param = V::mul(param, V::set1(c.param_decay));
  const R m1 = V::fma(V::set1(c.beta1), V::load_f32(m + i), V::mul(V::set1(c.one_minus_beta1), grad));
  const R v1 = V::fma(V::set1(c.beta2), V::load_f32(v + i),
                      V::mul(V::mul(V::set1(c.one_minus_beta2), grad), grad));
  const R denom = V::fma(V::sqrt(v1), V::set1(c.inv_bias2_sqrt), V::set1(c.eps));
  param = V::fma(V::set1(c.neg_step_size), V::div(m1, denom), param);
  V::store_f32(m + i, m1);
  V::store_f32(v + i, v1);
  V::store_f32(p + i, param);
  store<V>(copy + i, param);
}

// torch.optim's SGD at element(s) i; on the first step the momentum buffer
// is set to the gradient (as torch does when it creates it) and not read.
template <class V, class G, class C>
ZC_HD void sgd_at(const SgdCoefs& c, float* p, const G* g, float* buf, C* copy, int64_t i) {
  using R = typename V::reg;
  R grad = V::mul(load<V>(g + i), V::set1(c.grad_scale));
  R param = V::load_f32(p + i);
  if (c.l2_decay != 0.0f) grad = V::fma(V::set1(c.l2_decay), param, grad);
  if (c.use_momentum) {
    const R b = c.first_step ? grad
                             : V::fma(V::set1(c.momentum), V::load_f32(buf + i),
                                      V::mul(V::set1(c.one_minus_dampening), grad));
    V::store_f32(buf + i, b);
    grad = c.nesterov ? V::fma(V::set1(c.momentum), b, grad) : b;
  }
  param = V::fma(V::set1(c.neg_lr), grad, param);
  V::store_f32(p + i, param);
  store<V>(copy + i, param);
}

// dst[i] += src[i], added in float and rounded once to dst's type.
template <class V, class D, class S>
ZC_HD void accumulate_at(D* dst, const S* src, int64_t i) {
  store<V>(dst + i, V::add(load<V>(dst + i), load<V>(src + i)));
}

// dst[i] = value, rounded to dst's type.
template <class V, class D>
ZC_HD void fill_at(D* dst, float value, int64_t i) {
  store<V>(dst + i, V::set1(value));
}

// acc + x * x in float64 (x is exact in float64), two roundings: the step
// of the gradient-norm reduction.
template <class V>
ZC_HD double add_square(double acc, double x) {
  return V::add_f64(acc, V::mul_f64(x, x));
}

}  // namespace zerocore::kernels
