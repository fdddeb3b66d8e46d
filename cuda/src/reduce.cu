// The sum of squares of every element of a list of tensors, in one launch:
// blocks take fixed-size chunks of all tensors in a grid-stride loop
// (finding their tensor in a table in device memory, as the optimizers find
// their run), each thread adding squares in float64 with element_math.h's
// add_square, then a fixed tree over the block's threads. Each block writes
// its partial sum to the stream's scratch; the last block to finish (an
// atomic count, after a memory fence) adds the partials in block order and
// writes the result and the finiteness flag (or, counting non-finite
// tensors for the step's verdict, adds 1 to a counter when the sum is not
// finite). The grid depends only on the
// device, so the bits are the same on every call on one device.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "chunks.cuh"
#include "cuda_check.h"
#include "cuda_ops.cuh"
#include "device_table.h"
#include "launch.h"
#include "zerocore/cuda_reduce.h"
#include "zerocore/error.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore {
namespace {

using cuda_detail::CudaOps;
using cuda_detail::kChunk;
using cuda_detail::kThreads;

// One tensor in the device's table; 32 bytes, no padding (the table is
// cached by its bytes).
struct Segment {
  const void* data;
  int64_t n;
  int64_t first_chunk;  // chunks of the tensors before this one
  int64_t dtype;        // DType
};

// What a reduction on one stream needs between its blocks.
struct Scratch {
  double* partials;    // one per block of the largest grid
  unsigned* arrived;   // blocks done; the last one resets it to 0
  double* result;      // sum and flag, when the caller's memory is pageable
};

template <class T>
__device__ double add_squares(double acc, const T* p, int64_t begin, int64_t end) {
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    acc = kernels::add_square<CudaOps>(acc, double(kernels::load<CudaOps>(p + i)));
  }
  return acc;
}

// The sum of every thread's `x`, in a fixed tree; valid in thread 0.
__device__ double block_sum(double x, double* shared) {
  shared[threadIdx.x] = x;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (int(threadIdx.x) < width) shared[threadIdx.x] = CudaOps::add_f64(shared[threadIdx.x], shared[threadIdx.x + width]);
    __syncthreads();
  }
  return shared[0];
}

__global__ void __launch_bounds__(kThreads)
    sum_of_squares_kernel(const Segment* segs, int num_segs, int64_t chunks, Scratch scratch, double* sum,
                          double* finite, float* nonfinite) {
  __shared__ double shared[kThreads];
  __shared__ bool last;
  double acc = 0.0;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const Segment s = segs[cuda_detail::entry_of(segs, num_segs, chunk)];
    const int64_t begin = (chunk - s.first_chunk) * kChunk;
    const int64_t end = min(begin + kChunk, s.n);
    switch (DType(s.dtype)) {
      case DType::kFloat32: acc = add_squares(acc, static_cast<const float*>(s.data), begin, end); break;
      case DType::kBFloat16: acc = add_squares(acc, static_cast<const kernels::Bf16*>(s.data), begin, end); break;
      case DType::kFloat16: acc = add_squares(acc, static_cast<const kernels::Fp16*>(s.data), begin, end); break;
      case DType::kInt64:
      case DType::kInt40: break;  // refused on the host (no float sum of squares of integer sums)
    }
  }
  const double block_total = block_sum(acc, shared);
  if (threadIdx.x == 0) {
    scratch.partials[blockIdx.x] = block_total;
    __threadfence();  // the partial is visible to the last block before it counts this one
    last = atomicAdd(scratch.arrived, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  // Every partial, in block order (strided by thread, then the tree).
  const volatile double* partials = scratch.partials;
  double mine = 0.0;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) mine = CudaOps::add_f64(mine, partials[b]);
  const double total = block_sum(mine, shared);
  if (threadIdx.x == 0) {
    *sum = total;
    // Squares of finite floats cannot overflow float64 here, so the sum is
    // finite exactly when every element is (as cpu_reduce.h).
    *finite = isfinite(total) ? 1.0 : 0.0;
    if (nonfinite != nullptr && !isfinite(total)) *nonfinite += 1.0f;
    *scratch.arrived = 0;
  }
}

// The scratch of `stream` on `device`, allocated on its first reduction.
Scratch scratch_for(int device, cudaStream_t stream, int max_blocks) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, Scratch> scratches;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = scratches.find({device, stream});
  if (it != scratches.end()) return it->second;
  Scratch s{};
  cuda_detail::check(cudaMalloc(reinterpret_cast<void**>(&s.partials), size_t(max_blocks) * sizeof(double)),
                     "cudaMalloc(sum of squares scratch)");
  cuda_detail::check(cudaMalloc(reinterpret_cast<void**>(&s.arrived), sizeof(unsigned)),
                     "cudaMalloc(sum of squares counter)");
  cuda_detail::check(cudaMalloc(reinterpret_cast<void**>(&s.result), 2 * sizeof(double)),
                     "cudaMalloc(sum of squares result)");
  // In the stream's order, so the first kernel on it sees the count at zero.
  cuda_detail::check(cudaMemsetAsync(s.arrived, 0, sizeof(unsigned), stream), "cudaMemsetAsync(sum of squares counter)");
  scratches.emplace(std::make_pair(device, stream), s);
  return s;
}

// Where a kernel writes `p`: itself for device memory, its device alias
// for pinned host memory (the same address under unified addressing), null
// for pageable host memory, which a kernel cannot write.
double* kernel_pointer(double* p) {
  cudaPointerAttributes attributes{};
  cuda_detail::check(cudaPointerGetAttributes(&attributes, p), "cudaPointerGetAttributes");
  if (attributes.type == cudaMemoryTypeUnregistered) return nullptr;
  return attributes.devicePointer ? static_cast<double*>(attributes.devicePointer) : p;
}

// The sum kernel's launch over xs; `nonfinite`: a device counter, or null.
// sum and finite null: the stream's scratch takes them (no caller reads
// them; the counter is what it reads).
void launch_sum_of_squares(const std::vector<Tensor>& xs, int device, double* sum, double* finite, float* nonfinite,
                           void* stream) {
  const Device cuda{DeviceType::kCUDA, device};
  std::vector<Segment> segs;
  int64_t chunks = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].device() != cuda) {
      throw TypeMismatch("cuda_sum_of_squares: tensor " + std::to_string(i) + " is not on cuda:" + std::to_string(device));
    }
    if (xs[i].dtype() == DType::kInt64 || xs[i].dtype() == DType::kInt40) {
      throw TypeMismatch("cuda_sum_of_squares: integer elements (float ones only)");
    }
    if (xs[i].numel() == 0) continue;
    segs.push_back(Segment{xs[i].data(), xs[i].numel(), chunks, int64_t(xs[i].dtype())});
    chunks += cuda_detail::chunks_of(xs[i].numel());
  }
  // With nothing to add, one block still writes 0 and "finite"; it reads no
  // segment, so the table is a dummy entry.
  if (segs.empty()) segs.push_back(Segment{nullptr, 0, 0, 0});
  cuda_detail::DeviceGuard guard(device);
  auto* cu_stream = static_cast<cudaStream_t>(stream);
  const int max_blocks = cuda_detail::grid_size(device, INT64_MAX);
  const Scratch scratch = scratch_for(device, cu_stream, max_blocks);
  const auto* table =
      static_cast<const Segment*>(cuda_detail::device_table(device, segs.data(), segs.size() * sizeof(Segment)));
  const bool to_scratch = sum == nullptr;
  double* const sum_at = to_scratch ? scratch.result : kernel_pointer(sum);
  double* const finite_at = to_scratch ? scratch.result + 1 : kernel_pointer(finite);
  const bool direct = sum_at && finite_at;
  sum_of_squares_kernel<<<cuda_detail::grid_size(device, chunks), kThreads, 0, cu_stream>>>(
      table, int(segs.size()), chunks, scratch, direct ? sum_at : scratch.result, direct ? finite_at : scratch.result + 1,
      nonfinite);
  cuda_detail::check(cudaGetLastError(), "sum of squares kernel launch");
  if (!direct) {
    cuda_detail::check(cudaMemcpyAsync(sum, scratch.result, sizeof(double), cudaMemcpyDeviceToHost, cu_stream),
                       "cudaMemcpyAsync(sum of squares to pageable memory)");
    cuda_detail::check(cudaMemcpyAsync(finite, scratch.result + 1, sizeof(double), cudaMemcpyDeviceToHost, cu_stream),
                       "cudaMemcpyAsync(finiteness flag to pageable memory)");
  }
}

}  // namespace

void cuda_sum_of_squares(const std::vector<Tensor>& xs, int device, double* sum, double* finite, void* stream) {
  launch_sum_of_squares(xs, device, sum, finite, nullptr, stream);
}

void cuda_count_nonfinite(const std::vector<Tensor>& xs, int device, const Tensor& counter, void* stream) {
  if (counter.dtype() != DType::kFloat32 || counter.numel() != 1 ||
      counter.device() != Device{DeviceType::kCUDA, device}) {
    throw TypeMismatch("cuda_count_nonfinite: the counter must be one fp32 element on cuda:" + std::to_string(device));
  }
  launch_sum_of_squares(xs, device, nullptr, nullptr, counter.data_as<float>(), stream);
}

}  // namespace zerocore
