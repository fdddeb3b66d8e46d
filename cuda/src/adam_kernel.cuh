// The fused Adam/AdamW kernel on flat partitions: one pass reads the gradient
// (fp32/bf16/fp16) and the fp32 param, exp_avg and exp_avg_sq, writes the
// three fp32 arrays back and, optionally, a bf16/fp16 copy of the new param.
// The update is bandwidth-bound (28 bytes a parameter with a 16-bit grad and
// copy), so the kernel's only job is to stream memory well: 16-byte loads
// where every array is aligned for them, a grid-stride loop over a grid
// sized to fill the device once, and no second pass for the copy.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "zerocore/kernels/optim.h"

namespace zerocore::cuda_detail {

// Per-step constants: zerocore::AdamCoefs, computed on the host by
// adam_coefs() exactly as for the CPU kernels.
using zerocore::AdamCoefs;

// Marks "no param copy" so the copy store compiles away.
struct NoCopy {};

template <typename T>
__device__ __forceinline__ float load_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>);
    return __bfloat162float(x);
  }
}

// Round to nearest even, as torch's .to(bfloat16) / .to(float16), so the
// copy equals param.to(dtype) bit for bit.
template <typename T>
__device__ __forceinline__ T store_float(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>);
    return __float2bfloat16_rn(x);
  }
}

// One element of torch.optim's Adam/AdamW (eps outside the square root, bias
// corrections folded into the scalars). The operations, their order and the
// fused multiply-adds are spelled out with the _rn intrinsics, which nvcc
// never contracts or reorders, so that the result is bit-identical to the
// CPU kernels (cpp/src/cpu_kernels_impl.h, adam_at), whose scalar path is
// the reference: a ZeRO-Offload run and a GPU run of the same step agree.
// The terms are skipped on their values, as the CPU does, so a zero decay
// never turns 0 * inf into NaN.
__device__ __forceinline__ void adam_element(float& p, float& m, float& v, float g,
                                             const AdamCoefs& s) {
  g = __fmul_rn(g, s.grad_scale);
  if (s.l2_decay != 0.0f) g = __fmaf_rn(s.l2_decay, p, g);
  if (s.param_decay != 1.0f) p = __fmul_rn(p, s.param_decay);
  m = __fmaf_rn(s.beta1, m, __fmul_rn(s.one_minus_beta1, g));
  v = __fmaf_rn(s.beta2, v, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fmaf_rn(__fsqrt_rn(v), s.inv_bias2_sqrt, s.eps);
  p = __fmaf_rn(s.neg_step_size, __fdiv_rn(m, denom), p);
}

// N consecutive elements in one aligned load/store (N = 4: 16 bytes of fp32,
// 8 bytes of 16-bit data). Only used when the host has checked alignment.
template <typename T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* base, int64_t pack) {
  return reinterpret_cast<const Pack<T, N>*>(base)[pack];
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* base, int64_t pack, const Pack<T, N>& x) {
  reinterpret_cast<Pack<T, N>*>(base)[pack] = x;
}

// G: gradient element type; C: param-copy type or NoCopy; N: elements per
// vector access (1 or 4). Threads first walk the n / N whole packs, then the
// n % N tail elements one by one (no tail when N == 1).
template <typename G, typename C, int N>
__global__ void __launch_bounds__(256)
    adam_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
                float* __restrict__ exp_avg_sq, C* __restrict__ copy, int64_t n, AdamCoefs s) {
  constexpr bool kCopy = !std::is_same_v<C, NoCopy>;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;

  const int64_t packs = n / N;
  for (int64_t i = first; i < packs; i += stride) {
    Pack<float, N> p = load_pack<float, N>(param, i);
    Pack<float, N> m = load_pack<float, N>(exp_avg, i);
    Pack<float, N> v = load_pack<float, N>(exp_avg_sq, i);
    const Pack<G, N> g = load_pack<G, N>(grad, i);
#pragma unroll
    for (int k = 0; k < N; ++k) adam_element(p.v[k], m.v[k], v.v[k], load_float(g.v[k]), s);
    store_pack<float, N>(param, i, p);
    store_pack<float, N>(exp_avg, i, m);
    store_pack<float, N>(exp_avg_sq, i, v);
    if constexpr (kCopy) {
      Pack<C, N> c;
#pragma unroll
      for (int k = 0; k < N; ++k) c.v[k] = store_float<C>(p.v[k]);
      store_pack<C, N>(copy, i, c);
    }
  }

  if constexpr (N > 1) {
    for (int64_t i = packs * N + first; i < n; i += stride) {
      float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
      adam_element(p, m, v, load_float(grad[i]), s);
      param[i] = p;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      if constexpr (kCopy) copy[i] = store_float<C>(p);
    }
  }
}

}  // namespace zerocore::cuda_detail
