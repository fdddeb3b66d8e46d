// Host side of the CUDA Adam/AdamW update: argument checks, per-step
// scalars, choice of kernel instantiation, launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "adam_kernel.cuh"
#include "cuda_check.h"
#include "zerocore/cuda_optim.h"
#include "zerocore/error.h"
#include "zerocore/kernels/optim.h"
#include "zerocore/kernels/optim_args.h"

namespace zerocore {
namespace {

using cuda_detail::NoCopy;

constexpr int kThreads = 256;  // matches __launch_bounds__ in adam_kernel.cuh

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Enough blocks to fill every SM once (the grid-stride loop does the rest),
// never more than the work needs.
int grid_size(int device, int64_t work_items) {
  int sms = 0, threads_per_sm = 0;
  cuda_detail::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                     "cudaDeviceGetAttribute(MultiProcessorCount)");
  cuda_detail::check(
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device),
      "cudaDeviceGetAttribute(MaxThreadsPerMultiProcessor)");
  const int64_t resident = int64_t(sms) * std::max(1, threads_per_sm / kThreads);
  const int64_t needed = (work_items + kThreads - 1) / kThreads;
  return int(std::max<int64_t>(1, std::min(resident, needed)));
}

template <typename G, typename C>
void launch(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
            const Tensor& exp_avg_sq, const Tensor& param_copy, const AdamCoefs& s,
            cudaStream_t stream, int device) {
  float* p = param.data_as<float>();
  const G* g = grad.data_as<const G>();
  float* m = exp_avg.data_as<float>();
  float* v = exp_avg_sq.data_as<float>();
  C* c = nullptr;
  if constexpr (!std::is_same_v<C, NoCopy>) c = param_copy.data_as<C>();
  const int64_t n = param.numel();

  // 4-wide access needs every array aligned to its pack size; views at odd
  // offsets into a flat buffer take the scalar path instead.
  constexpr int kVec = 4;
  bool vec = aligned(p, kVec * sizeof(float)) && aligned(m, kVec * sizeof(float)) &&
             aligned(v, kVec * sizeof(float)) && aligned(g, kVec * sizeof(G));
  if constexpr (!std::is_same_v<C, NoCopy>) vec = vec && aligned(c, kVec * sizeof(C));

  if (vec) {
    cuda_detail::adam_kernel<G, C, kVec>
        <<<grid_size(device, std::max(n / kVec, n % kVec)), kThreads, 0, stream>>>(p, g, m, v, c,
                                                                                   n, s);
  } else {
    cuda_detail::adam_kernel<G, C, 1>
        <<<grid_size(device, n), kThreads, 0, stream>>>(p, g, m, v, c, n, s);
  }
  cuda_detail::check(cudaGetLastError(), "adam_ kernel launch");
}

template <typename G>
void launch_for_grad(DType copy_dtype, bool has_copy, const Tensor& param, const Tensor& grad,
                     const Tensor& exp_avg, const Tensor& exp_avg_sq, const Tensor& param_copy,
                     const AdamCoefs& s, cudaStream_t stream, int device) {
  if (!has_copy) {
    launch<G, NoCopy>(param, grad, exp_avg, exp_avg_sq, param_copy, s, stream, device);
  } else if (copy_dtype == DType::kBFloat16) {
    launch<G, __nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, param_copy, s, stream, device);
  } else {
    launch<G, __half>(param, grad, exp_avg, exp_avg_sq, param_copy, s, stream, device);
  }
}

}  // namespace

void cuda_adam_update(const AdamOptions& options, int64_t step, double grad_scale,
                      const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                      const Tensor& exp_avg_sq, const Tensor& param_copy, void* stream) {
  // Everything must live on param's device; if param itself is not a CUDA
  // tensor, check_flat_update reports it as a device mismatch.
  const int device = param.device().index;
  check_flat_update("adam_", Device{DeviceType::kCUDA, device}, param, grad,
                    {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}}, param_copy);
  // The CPU path's checks and coefficients: same messages, same rounding.
  const AdamCoefs s = adam_coefs(options, step, grad_scale);
  if (param.numel() == 0) return;

  const bool has_copy = is_given(param_copy);
  const DType copy_dtype = has_copy ? param_copy.dtype() : DType::kFloat32;
  auto* cu_stream = static_cast<cudaStream_t>(stream);

  cuda_detail::DeviceGuard guard(device);
  switch (grad.dtype()) {
    case DType::kFloat32:
      launch_for_grad<float>(copy_dtype, has_copy, param, grad, exp_avg, exp_avg_sq, param_copy, s,
                             cu_stream, device);
      break;
    case DType::kBFloat16:
      launch_for_grad<__nv_bfloat16>(copy_dtype, has_copy, param, grad, exp_avg, exp_avg_sq,
                                     param_copy, s, cu_stream, device);
      break;
    case DType::kFloat16:
      launch_for_grad<__half>(copy_dtype, has_copy, param, grad, exp_avg, exp_avg_sq, param_copy,
                              s, cu_stream, device);
      break;
  }
}

}  // namespace zerocore
