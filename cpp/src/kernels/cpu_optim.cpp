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

// The group of run i, checked against the options given; the message names
// the run when there are several.
template <class Options>
const Options& options_of(const char* op, const std::vector<Options>& groups, const std::vector<FlatRun>& runs,
                          size_t i) {
  const int g = runs[i].group;
  if (g < 0 || size_t(g) >= groups.size()) {
    throw InvalidArgument(std::string(op) + ": run " + std::to_string(i) + " belongs to group " + std::to_string(g) +
                          " but options were given for " + std::to_string(groups.size()) + " group(s)");
  }
  return groups[size_t(g)];
}

std::string run_op(const char* op, const std::vector<FlatRun>& runs, size_t i) {
  return runs.size() == 1 ? std::string(op) : std::string(op) + " (run " + std::to_string(i) + ")";
}

// Runs kernel(coefs[run.group], args of run, begin, end) over every run's
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
    kernel(coefs[size_t(runs[i].group)], args[i], b, e);
  });
}

}  // namespace

void adam_update_runs(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                      const std::vector<FlatRun>& runs) {
  std::vector<AdamCoefs> coefs;
  for (const AdamOptions& o : groups) coefs.push_back(adam_coefs(o, step, grad_scale));
  for (size_t i = 0; i < runs.size(); ++i) {
    options_of("adam_", groups, runs, i);
    const FlatRun& r = runs[i];
    check_flat_update(run_op("adam_", runs, i).c_str(), Device{}, r.param, r.grad,
                      {{"exp_avg", &r.state0}, {"exp_avg_sq", &r.state1}}, r.param_copy);
  }
  update_runs(coefs, runs, active_kernels().adam);
}

void sgd_update_runs(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                     const std::vector<FlatRun>& runs) {
  std::vector<SgdCoefs> coefs;
  for (const SgdOptions& o : groups) coefs.push_back(sgd_coefs(o, step, grad_scale));
  for (size_t i = 0; i < runs.size(); ++i) {
    const FlatRun& r = runs[i];
    const std::string op = run_op("sgd_", runs, i);
    if (options_of("sgd_", groups, runs, i).momentum != 0.0) {
      check_flat_update(op.c_str(), Device{}, r.param, r.grad, {{"momentum_buffer", &r.state0}}, r.param_copy);
    } else {
      check_flat_update(op.c_str(), Device{}, r.param, r.grad, {}, r.param_copy);
    }
  }
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
