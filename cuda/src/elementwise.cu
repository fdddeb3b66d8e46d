// Accumulate-and-cast and fill on CUDA tensors, instantiating
// kernels/element_math.h with cuda_ops.cuh: the same rounding as the CPU's
// accumulate() and fill(); int64 (Config(deterministic=True)'s exact sums)
// adds and fills integers, as the CPU's does. Grid-stride loops, in packs of four elements when
// both arrays are aligned for them.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "cuda_check.h"
#include "cuda_ops.cuh"
#include "launch.h"
#include "zerocore/cuda_elementwise.h"
#include "zerocore/error.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore {
namespace {

using cuda_detail::CudaOps;
using cuda_detail::CudaPack4Ops;
using cuda_detail::kThreads;

constexpr int kPack = CudaPack4Ops::width;

// f(ops, i) over [0, n): whole packs with CudaPack4Ops when `packed`, the
// rest element by element.
template <class F>
__device__ void grid_stride(int64_t n, bool packed, F f) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs_end = packed ? n / kPack * kPack : 0;
  for (int64_t i = first * kPack; i < packs_end; i += stride * kPack) f(CudaPack4Ops{}, i);
  for (int64_t i = packs_end + first; i < n; i += stride) f(CudaOps{}, i);
}

template <class D, class S>
__global__ void __launch_bounds__(kThreads) accumulate_kernel(D* dst, const S* src, int64_t n, bool packed) {
  grid_stride(n, packed, [=](auto ops, int64_t i) { kernels::accumulate_at<decltype(ops)>(dst, src, i); });
}

// Config(deterministic=True)'s exact sums: integers into integers.
__global__ void __launch_bounds__(kThreads) accumulate_int64_kernel(int64_t* dst, const int64_t* src, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] += src[i];
}

// A grad onto its grid and into the int64 staging: round(src * scale),
// ties to even (__double2ll_rn, IEEE round-to-nearest-even), as the host's
// accumulate_on_grid; 0 past int64 or not finite (the step is skipped).
// The largest |src| as the host keeps it: the bits of |x| order as |x|
// (a NaN's above an inf's), so an unsigned maximum over them, a warp's
// first and then one atomicMax a warp into *largest.
template <class S>
__global__ void __launch_bounds__(kThreads) accumulate_on_grid_kernel(int64_t* dst, const S* src, double scale,
                                                                       int64_t n, unsigned int* largest) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  unsigned int top = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = kernels::load<CudaOps>(src + i);
    top = max(top, __float_as_uint(x) & 0x7FFFFFFFu);
    const double r = double(x) * scale;
    dst[i] += fabs(r) < 9.2e18 ? __double2ll_rn(r) : 0;
  }
  for (int offset = 16; offset > 0; offset /= 2) top = max(top, __shfl_down_sync(0xFFFFFFFFu, top, offset));
  if ((threadIdx.x & 31) == 0) atomicMax(largest, top);
}

__global__ void __launch_bounds__(kThreads) accumulate_int40_kernel(uint8_t* dst, const int64_t* src, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    kernels::add_to_int40(dst + 5 * i, src[i]);
  }
}

__global__ void __launch_bounds__(kThreads) fill_int64_kernel(int64_t* dst, int64_t value, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = value;
}

template <class D>
__global__ void __launch_bounds__(kThreads) fill_kernel(D* dst, float value, int64_t n, bool packed) {
  grid_stride(n, packed, [=](auto ops, int64_t i) { kernels::fill_at<decltype(ops)>(dst, value, i); });
}

int64_t blocks_for(int64_t n) { return (n / kPack + n % kPack + kThreads - 1) / kThreads; }

std::string where(const Tensor& t) {
  return t.device().type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(t.device().index);
}

}  // namespace

void cuda_accumulate(const Tensor& dst, const Tensor& src, void* stream) {
  const Device device{DeviceType::kCUDA, dst.device().index};
  if (dst.device() != device || src.device() != device) {
    throw TypeMismatch("cuda_accumulate: both tensors must be on one CUDA device, got dst on " + where(dst) +
                       " and src on " + where(src));
  }
  if (dst.numel() != src.numel()) {
    throw InvalidArgument("cuda_accumulate: " + std::to_string(src.numel()) + " elements into " +
                          std::to_string(dst.numel()));
  }
  const bool into_int40 = dst.dtype() == DType::kInt40;  // a partition's exact sums
  if (into_int40 && src.dtype() != DType::kInt64) throw TypeMismatch("cuda_accumulate: int40 sums take int64 elements only");
  const bool integers = dst.dtype() == DType::kInt64 || src.dtype() == DType::kInt64;  // exact sums
  if (!into_int40 && integers && dst.dtype() != src.dtype()) {
    throw TypeMismatch("cuda_accumulate: int64 sums take int64 elements only");
  }
  const int64_t n = dst.numel();
  if (n == 0) return;
  cuda_detail::DeviceGuard guard(device.index);
  if (into_int40) {
    accumulate_int40_kernel<<<cuda_detail::grid_size(device.index, (n + kThreads - 1) / kThreads), kThreads, 0,
                              static_cast<cudaStream_t>(stream)>>>(static_cast<uint8_t*>(dst.data()),
                                                                   static_cast<const int64_t*>(src.data()), n);
    cuda_detail::check(cudaGetLastError(), "cuda_accumulate kernel launch");
    return;
  }
  if (integers) {
    accumulate_int64_kernel<<<cuda_detail::grid_size(device.index, (n + kThreads - 1) / kThreads), kThreads, 0,
                              static_cast<cudaStream_t>(stream)>>>(static_cast<int64_t*>(dst.data()),
                                                                   static_cast<const int64_t*>(src.data()), n);
    cuda_detail::check(cudaGetLastError(), "cuda_accumulate kernel launch");
    return;
  }
  const bool packed = cuda_detail::aligned(dst.data(), kPack * dtype_size(dst.dtype())) &&
                      cuda_detail::aligned(src.data(), kPack * dtype_size(src.dtype()));
  kernels::with_element_type(dst.dtype(), [&](auto d_type) {
    kernels::with_element_type(src.dtype(), [&](auto s_type) {
      using D = decltype(d_type);
      using S = decltype(s_type);
      accumulate_kernel<D, S>
          <<<cuda_detail::grid_size(device.index, blocks_for(n)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
              static_cast<D*>(dst.data()), static_cast<const S*>(src.data()), n, packed);
    });
  });
  cuda_detail::check(cudaGetLastError(), "cuda_accumulate kernel launch");
}

void cuda_accumulate_on_grid(const Tensor& dst, const Tensor& src, int exponent, const Tensor& largest,
                             void* stream) {
  const Device device{DeviceType::kCUDA, dst.device().index};
  if (dst.device() != device || src.device() != device || largest.device() != device) {
    throw TypeMismatch("cuda_accumulate_on_grid: the tensors must be on one CUDA device, got dst on " + where(dst) +
                       ", src on " + where(src) + " and largest on " + where(largest));
  }
  if (dst.dtype() != DType::kInt64) throw TypeMismatch("cuda_accumulate_on_grid: dst must be int64");
  if (largest.dtype() != DType::kFloat32 || largest.numel() != 1) {
    throw TypeMismatch("cuda_accumulate_on_grid: largest must be one float32 element");
  }
  if (dst.numel() != src.numel()) {
    throw InvalidArgument("cuda_accumulate_on_grid: " + std::to_string(src.numel()) + " elements into " +
                          std::to_string(dst.numel()));
  }
  const int64_t n = dst.numel();
  if (n == 0) return;
  cuda_detail::DeviceGuard guard(device.index);
  const double scale = std::ldexp(1.0, -exponent);  // a power of two: the product is exact
  kernels::with_element_type(src.dtype(), [&](auto s_type) {
    using S = decltype(s_type);
    accumulate_on_grid_kernel<S><<<cuda_detail::grid_size(device.index, (n + kThreads - 1) / kThreads), kThreads, 0,
                                   static_cast<cudaStream_t>(stream)>>>(
        static_cast<int64_t*>(dst.data()), static_cast<const S*>(src.data()), scale, n,
        static_cast<unsigned int*>(largest.data()));
  });
  cuda_detail::check(cudaGetLastError(), "cuda_accumulate_on_grid kernel launch");
}

void cuda_fill(const Tensor& dst, float value, void* stream) {
  if (dst.device().type != DeviceType::kCUDA) {
    throw TypeMismatch("cuda_fill: the tensor must be on a CUDA device, got " + where(dst));
  }
  const int64_t n = dst.numel();
  if (n == 0) return;
  cuda_detail::DeviceGuard guard(dst.device().index);
  if (dst.dtype() == DType::kInt40) {  // a partition's exact sums: zeroed only, bytewise
    if (value != 0.0f) throw InvalidArgument("cuda_fill: int40 sums are only zeroed");
    cuda_detail::check(cudaMemsetAsync(dst.data(), 0, size_t(5 * n), static_cast<cudaStream_t>(stream)),
                       "cuda_fill memset");
    return;
  }
  if (dst.dtype() == DType::kInt64) {  // exact sums: integers
    fill_int64_kernel<<<cuda_detail::grid_size(dst.device().index, (n + kThreads - 1) / kThreads), kThreads, 0,
                        static_cast<cudaStream_t>(stream)>>>(static_cast<int64_t*>(dst.data()), int64_t(value), n);
    cuda_detail::check(cudaGetLastError(), "cuda_fill kernel launch");
    return;
  }
  const bool packed = cuda_detail::aligned(dst.data(), kPack * dtype_size(dst.dtype()));
  kernels::with_element_type(dst.dtype(), [&](auto d_type) {
    using D = decltype(d_type);
    fill_kernel<D><<<cuda_detail::grid_size(dst.device().index, blocks_for(n)), kThreads, 0,
                     static_cast<cudaStream_t>(stream)>>>(static_cast<D*>(dst.data()), value, n, packed);
  });
  cuda_detail::check(cudaGetLastError(), "cuda_fill kernel launch");
}

}  // namespace zerocore
