// Internal interface between the optimizer front end (cpu_optim.cpp) and the
// per-ISA kernel tables (cpu_kernels_<isa>.cpp).
#pragma once
#include <cstdint>

#include "zerocore/dtype.h"
#include "zerocore/kernels/optim.h"

namespace zerocore::cpu {

// Raw pointers of one flat update; state1 is unused by SGD.
struct FlatArgs {
  float* param;
  const void* grad;
  DType grad_dtype;
  float* state0;  // Adam exp_avg, SGD momentum buffer
  float* state1;  // Adam exp_avg_sq
  void* copy;     // 16-bit param copy, or nullptr
  DType copy_dtype;
};

using AdamFn = void (*)(const AdamCoefs&, const FlatArgs&, int64_t begin, int64_t end);
using SgdFn = void (*)(const SgdCoefs&, const FlatArgs&, int64_t begin, int64_t end);

struct KernelTable {
  AdamFn adam;
  SgdFn sgd;
};

const KernelTable& scalar_kernels();
#if defined(__x86_64__) || defined(_M_X64)
#define ZEROCORE_X86_KERNELS 1
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
#endif

}  // namespace zerocore::cpu
