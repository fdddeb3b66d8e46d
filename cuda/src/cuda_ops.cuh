// The device's ops traits for kernels/element_math.h: the same IEEE
// operations as the CPU's ScalarVec (cpp/src/kernels/cpu_vec_scalar.h),
// spelled with the _rn intrinsics, which nvcc never contracts into fused
// multiply-adds or reorders, so the shared element functions round on the
// GPU exactly as on the CPU. CudaOps works on one float, CudaPack4Ops on
// four consecutive elements in one 16-byte (fp32) or 8-byte (16-bit) access,
// for arrays whose alignment the host has checked.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace zerocore::cuda_detail {

struct CudaOps {
  static constexpr int width = 1;
  using reg = float;
  __device__ static reg set1(float x) { return x; }
  __device__ static reg load_f32(const float* p) { return *p; }
  __device__ static void store_f32(float* p, reg x) { *p = x; }
  __device__ static reg load_bf16(const uint16_t* p) { return __bfloat162float(__ushort_as_bfloat16(*p)); }
  __device__ static reg load_fp16(const uint16_t* p) { return __half2float(__ushort_as_half(*p)); }
  // Round to nearest even, as torch's .to(bfloat16) / .to(float16).
  __device__ static void store_bf16(uint16_t* p, reg x) { *p = __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
  __device__ static void store_fp16(uint16_t* p, reg x) { *p = __half_as_ushort(__float2half_rn(x)); }
  __device__ static reg add(reg a, reg b) { return __fadd_rn(a, b); }
  __device__ static reg mul(reg a, reg b) { return __fmul_rn(a, b); }
  __device__ static reg div(reg a, reg b) { return __fdiv_rn(a, b); }
  __device__ static reg sqrt(reg a) { return __fsqrt_rn(a); }
  __device__ static reg fma(reg a, reg b, reg c) { return __fmaf_rn(a, b, c); }
  __device__ static double add_f64(double a, double b) { return __dadd_rn(a, b); }
  __device__ static double mul_f64(double a, double b) { return __dmul_rn(a, b); }
};

// Four lanes of CudaOps; loads and stores are single vector accesses.
struct CudaPack4Ops {
  static constexpr int width = 4;
  struct reg {
    float x[4];
  };
  template <class F>
  __device__ static reg each(F f) {
    reg r;
#pragma unroll
    for (int k = 0; k < 4; ++k) r.x[k] = f(k);
    return r;
  }
  struct alignas(8) Half4 {
    uint16_t h[4];
  };
  __device__ static reg set1(float x) { return reg{{x, x, x, x}}; }
  __device__ static reg load_f32(const float* p) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    return reg{{v.x, v.y, v.z, v.w}};
  }
  __device__ static void store_f32(float* p, reg a) {
    *reinterpret_cast<float4*>(p) = make_float4(a.x[0], a.x[1], a.x[2], a.x[3]);
  }
  __device__ static reg load_bf16(const uint16_t* p) {
    const Half4 v = *reinterpret_cast<const Half4*>(p);
    return each([&](int k) { return CudaOps::load_bf16(&v.h[k]); });
  }
  __device__ static reg load_fp16(const uint16_t* p) {
    const Half4 v = *reinterpret_cast<const Half4*>(p);
    return each([&](int k) { return CudaOps::load_fp16(&v.h[k]); });
  }
  __device__ static void store_bf16(uint16_t* p, reg a) {
    Half4 v;
#pragma unroll
    for (int k = 0; k < 4; ++k) CudaOps::store_bf16(&v.h[k], a.x[k]);
    *reinterpret_cast<Half4*>(p) = v;
  }
  __device__ static void store_fp16(uint16_t* p, reg a) {
    Half4 v;
#pragma unroll
    for (int k = 0; k < 4; ++k) CudaOps::store_fp16(&v.h[k], a.x[k]);
    *reinterpret_cast<Half4*>(p) = v;
  }
  __device__ static reg add(reg a, reg b) { return each([&](int k) { return CudaOps::add(a.x[k], b.x[k]); }); }
  __device__ static reg mul(reg a, reg b) { return each([&](int k) { return CudaOps::mul(a.x[k], b.x[k]); }); }
  __device__ static reg div(reg a, reg b) { return each([&](int k) { return CudaOps::div(a.x[k], b.x[k]); }); }
  __device__ static reg sqrt(reg a) { return each([&](int k) { return CudaOps::sqrt(a.x[k]); }); }
  __device__ static reg fma(reg a, reg b, reg c) {
    return each([&](int k) { return CudaOps::fma(a.x[k], b.x[k], c.x[k]); });
  }
};

}  // namespace zerocore::cuda_detail
