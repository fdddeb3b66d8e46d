// Front end of the CPU optimizers: checks arguments, turns hyperparameters
// into per-call coefficients, and splits the flat range over the thread pool
// for the kernel table of the active instruction set.
#include "zerocore/cpu_optim.h"

#include "cpu_kernels.h"
#include "zerocore/cpu_features.h"
#include "zerocore/error.h"
#include "zerocore/optim_args.h"
#include "zerocore/thread_pool.h"

namespace zerocore {

namespace {

// Chunk boundaries every 64 elements keep threads off each other's cache
// lines for both the fp32 and the 16-bit arrays.
constexpr int64_t kChunkAlign = 64;

const cpu::KernelTable& active_kernels() {
  switch (active_isa()) {
#ifdef ZEROCORE_X86_KERNELS
    case Isa::kAvx512: return cpu::avx512_kernels();
    case Isa::kAvx2: return cpu::avx2_kernels();
#endif
    default: return cpu::scalar_kernels();
  }
}

cpu::FlatArgs flat_args(const Tensor& param, const Tensor& grad, const Tensor& s0, const Tensor& s1,
                        const Tensor& copy) {
  return cpu::FlatArgs{param.data_as<float>(),
                       grad.data(),
                       grad.dtype(),
                       is_given(s0) ? s0.data_as<float>() : nullptr,
                       is_given(s1) ? s1.data_as<float>() : nullptr,
                       is_given(copy) ? copy.data() : nullptr,
                       is_given(copy) ? copy.dtype() : DType::kBFloat16};
}

}  // namespace

void adam_update(const AdamOptions& o, int64_t step, double grad_scale, const Tensor& param,
                 const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                 const Tensor& param_copy) {
  const char* op = "adam_";
  check_flat_update(op, Device{}, param, grad, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}},
                    param_copy);
  const AdamCoefs c = adam_coefs(o, step, grad_scale);
  const cpu::FlatArgs args = flat_args(param, grad, exp_avg, exp_avg_sq, param_copy);
  const cpu::AdamFn kernel = active_kernels().adam;
  default_thread_pool().parallel_for(param.numel(), kChunkAlign,
                                     [&](int64_t b, int64_t e) { kernel(c, args, b, e); });
}

void sgd_update(const SgdOptions& o, int64_t step, double grad_scale, const Tensor& param,
                const Tensor& grad, const Tensor& momentum_buffer, const Tensor& param_copy) {
  const char* op = "sgd_";
  if (o.momentum != 0.0) {
    check_flat_update(op, Device{}, param, grad, {{"momentum_buffer", &momentum_buffer}}, param_copy);
  } else {
    check_flat_update(op, Device{}, param, grad, {}, param_copy);
  }
  const SgdCoefs c = sgd_coefs(o, step, grad_scale);
  const cpu::FlatArgs args = flat_args(param, grad, momentum_buffer, Tensor(), param_copy);
  const cpu::SgdFn kernel = active_kernels().sgd;
  default_thread_pool().parallel_for(param.numel(), kChunkAlign,
                                     [&](int64_t b, int64_t e) { kernel(c, args, b, e); });
}

}  // namespace zerocore
