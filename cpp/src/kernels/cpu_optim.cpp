// Front end of the CPU optimizers: checks arguments, turns hyperparameters
// into per-call coefficients, and splits the flat range over the thread pool
// for the kernel table of the active instruction set.
#include "zerocore/kernels/cpu_optim.h"

#include <string>

#include "cpu_kernels.h"
#include "zerocore/kernels/cpu_features.h"
#include "zerocore/error.h"
#include "zerocore/kernels/optim_args.h"
#include "zerocore/runtime/thread_pool.h"

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

cpu::FlatArgs flat_args(const FlatRun& r) {
  return cpu::FlatArgs{r.param.data_as<float>(),
                       r.grad.data(),
                       r.grad.dtype(),
                       is_given(r.state0) ? r.state0.data_as<float>() : nullptr,
                       is_given(r.state1) ? r.state1.data_as<float>() : nullptr,
                       is_given(r.param_copy) ? r.param_copy.data() : nullptr,
                       is_given(r.param_copy) ? r.param_copy.dtype() : DType::kBFloat16};
}

// Runs kernel(coefs[run.param_group], args of run, begin, end) over every run's
// elements, split over the thread pool together.
template <class Coefs, class Kernel>
void update_runs(const std::vector<Coefs>& coefs, const std::vector<FlatRun>& runs, Kernel kernel) {
  std::vector<int64_t> lengths;
  std::vector<cpu::FlatArgs> args;
  for (const FlatRun& r : runs) {
    lengths.push_back(r.param.numel());
    args.push_back(flat_args(r));
  }
  parallel_for_ranges(default_thread_pool(), lengths, kChunkAlign, [&](size_t i, int64_t b, int64_t e) {
    kernel(coefs[size_t(runs[i].param_group)], args[i], b, e);
  });
}

}  // namespace

void adam_update_runs(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                      const std::vector<FlatRun>& runs) {
  std::vector<AdamCoefs> coefs;
  for (const AdamOptions& o : groups) coefs.push_back(adam_coefs(o, step, grad_scale));
  check_adam_runs(Device{}, groups.size(), runs);
  update_runs(coefs, runs, active_kernels().adam);
}

void sgd_update_runs(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                     const std::vector<FlatRun>& runs) {
  std::vector<SgdCoefs> coefs;
  for (const SgdOptions& o : groups) coefs.push_back(sgd_coefs(o, step, grad_scale));
  check_sgd_runs(Device{}, groups, runs);
  update_runs(coefs, runs, active_kernels().sgd);
}

void adam_update(const AdamOptions& o, int64_t step, double grad_scale, const Tensor& param,
                 const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                 const Tensor& param_copy) {
  adam_update_runs({o}, step, grad_scale, {FlatRun{0, param, grad, exp_avg, exp_avg_sq, param_copy}});
}

void sgd_update(const SgdOptions& o, int64_t step, double grad_scale, const Tensor& param,
                const Tensor& grad, const Tensor& momentum_buffer, const Tensor& param_copy) {
  sgd_update_runs({o}, step, grad_scale, {FlatRun{0, param, grad, momentum_buffer, Tensor(), param_copy}});
}

}  // namespace zerocore
