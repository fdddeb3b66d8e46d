// STREAM-like reference kernels for cpu_adam_bench: what the memory system
// delivers to this process, measured with the same threads, the same arenas
// and the same access pattern as the optimizer update, so that the update's
// time can be stated as a fraction of the machine's limit.
//
// Built like the rest of the bench (no -march): the loops are plain C++ that
// the compiler vectorises with the baseline instruction set. They do almost
// no arithmetic, so they are limited by memory, not by vector width.
#pragma once
#include <cstdint>

#include "zerocore/runtime/thread_pool.h"

namespace zerocore::bench {

// The arrays of one full offload update: fp32 param and Adam state, a bf16
// gradient in and a bf16 param copy out.
struct OffloadArrays {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const uint16_t* grad_bf16;
  uint16_t* param_bf16;
  int64_t n;
};

// Bytes the program reads and writes per parameter: p, m, v (4 each) and
// the bf16 grad (2) in; p, m, v (4 each) and the bf16 copy (2) out.
constexpr double kOffloadBytesPerParam = 28.0;
// a[i] = b[i] + s * c[i]: two fp32 reads and one fp32 write.
constexpr double kTriadBytesPerParam = 12.0;

// Chunk boundaries on whole cache lines, as the optimizer's own split.
constexpr int64_t kStreamChunkAlign = 64;

// Same loads and stores as the offload Adam update with trivial arithmetic
// in between: read p, m, v, g; write p, m, v, copy. The bf16 copy keeps the
// top 16 bits (truncation is enough for a bandwidth reference).
inline void stream_offload(const OffloadArrays& a, float scale) {
  default_thread_pool().parallel_for(a.n, kStreamChunkAlign, [&](int64_t begin, int64_t end) {
    float* __restrict p = a.param;
    float* __restrict m = a.exp_avg;
    float* __restrict v = a.exp_avg_sq;
    const uint16_t* __restrict g = a.grad_bf16;
    uint16_t* __restrict copy = a.param_bf16;
    for (int64_t i = begin; i < end; ++i) {
      uint32_t gbits = uint32_t(g[i]) << 16;
      float gi;
      __builtin_memcpy(&gi, &gbits, 4);
      const float pi = p[i] + scale * gi;
      m[i] = m[i] + gi;
      v[i] = v[i] - gi;
      p[i] = pi;
      uint32_t pbits;
      __builtin_memcpy(&pbits, &pi, 4);
      copy[i] = uint16_t(pbits >> 16);
    }
  });
}

inline void stream_triad(float* a, const float* b, const float* c, float scale, int64_t n) {
  default_thread_pool().parallel_for(n, kStreamChunkAlign, [&](int64_t begin, int64_t end) {
    float* __restrict out = a;
    const float* __restrict x = b;
    const float* __restrict y = c;
    for (int64_t i = begin; i < end; ++i) out[i] = x[i] + scale * y[i];
  });
}

}  // namespace zerocore::bench
