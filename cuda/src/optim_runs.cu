// The CUDA optimizers on flat partitions: every run of a partition (each a
// stretch of one param group, as cpu_optim.h's FlatRun) in one launch per
// grad/copy dtype combination. The per-element math is
// kernels/element_math.h's, instantiated with cuda_ops.cuh, so it rounds
// exactly as the CPU kernels do.
//
// The update is bandwidth-bound (28 bytes a parameter with a 16-bit grad and
// copy), so the kernel's only job is to stream memory well: runs are cut
// into chunks that blocks take in a grid-stride loop over a grid sized to
// fill the device once; a run whose arrays are all aligned is read and
// written in 16-byte (fp32) / 8-byte (16-bit) packs, its tail and any
// unaligned run element by element.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "chunks.cuh"
#include "cuda_check.h"
#include "cuda_ops.cuh"
#include "device_table.h"
#include "launch.h"
#include "zerocore/cuda_optim.h"
#include "zerocore/error.h"
#include "zerocore/kernels/element_math.h"
#include "zerocore/kernels/optim_args.h"

namespace zerocore {
namespace {

using cuda_detail::CudaOps;
using cuda_detail::CudaPack4Ops;
using cuda_detail::aligned;
using cuda_detail::kChunk;
using cuda_detail::kThreads;

// Coefficients travel in the kernel's arguments (they change every step),
// read in place (__grid_constant__: no per-thread copy); this many groups
// fit well inside the 4 KiB argument space.
constexpr int kMaxGroups = 32;

// One run in the device's run table.
struct DeviceRun {
  float* param;
  const void* grad;
  float* state0;  // Adam exp_avg, SGD momentum buffer
  float* state1;  // Adam exp_avg_sq
  void* copy;     // 16-bit param copy, or nullptr
  int64_t n;
  int64_t first_chunk;  // chunks of the runs before this one in the table
  int32_t param_group;
  int32_t packed;  // every array aligned for CudaPack4Ops
};

template <class Coefs>
struct CoefTable {
  Coefs param_group[kMaxGroups];
};

struct AdamAt {
  template <class V, class G, class C>
  __device__ static void at(const AdamCoefs& c, const DeviceRun& r, const G* g, C* copy, int64_t i) {
    kernels::adam_at<V>(c, r.param, g, r.state0, r.state1, copy, i);
  }
};

struct SgdAt {
  template <class V, class G, class C>
  __device__ static void at(const SgdCoefs& c, const DeviceRun& r, const G* g, C* copy, int64_t i) {
    kernels::sgd_at<V>(c, r.param, g, r.state0, copy, i);
  }
};

// G: grad element type; C: copy type or kernels::NoCopy.
template <class Update, class G, class C, class Coefs>
__global__ void __launch_bounds__(kThreads)
    update_runs_kernel(const DeviceRun* runs, int num_runs, int64_t chunks,
                       const __grid_constant__ CoefTable<Coefs> coefs, const float* skip_if) {
  constexpr int kPack = CudaPack4Ops::width;
  if (skip_if != nullptr && *skip_if != 0.0f) return;  // refused on the device (Backend::adam_update_runs)
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const DeviceRun r = runs[cuda_detail::entry_of(runs, num_runs, chunk)];
    const Coefs& c = coefs.param_group[r.param_group];
    const G* g = static_cast<const G*>(r.grad);
    C* copy = static_cast<C*>(r.copy);
    const int64_t begin = (chunk - r.first_chunk) * kChunk;
    const int64_t end = min(begin + kChunk, r.n);
    const int64_t packs_end = r.packed ? begin + (end - begin) / kPack * kPack : begin;
    for (int64_t i = begin + int64_t(threadIdx.x) * kPack; i < packs_end; i += int64_t(blockDim.x) * kPack) {
      Update::template at<CudaPack4Ops>(c, r, g, copy, i);
    }
    for (int64_t i = packs_end + threadIdx.x; i < end; i += blockDim.x) {
      Update::template at<CudaOps>(c, r, g, copy, i);
    }
  }
}

// One launch over `runs`, whose grads all have element type G and copies
// type C.
template <class Update, class G, class C, class Coefs>
void launch(const CoefTable<Coefs>& coefs, std::vector<DeviceRun> runs, const float* skip_if, int device,
            cudaStream_t stream) {
  int64_t chunks = 0;
  for (DeviceRun& r : runs) {
    r.first_chunk = chunks;
    chunks += cuda_detail::chunks_of(r.n);
  }
  const auto* table =
      static_cast<const DeviceRun*>(cuda_detail::device_table(device, runs.data(), runs.size() * sizeof(DeviceRun)));
  update_runs_kernel<Update, G, C, Coefs>
      <<<cuda_detail::grid_size(device, chunks), kThreads, 0, stream>>>(table, int(runs.size()), chunks, coefs,
                                                                        skip_if);
  cuda_detail::check(cudaGetLastError(), "optimizer kernel launch");
}

DeviceRun device_run(const FlatRun& r) {
  auto ptr = [](const Tensor& t) { return is_given(t) ? t.data() : nullptr; };
  DeviceRun d{r.param.data_as<float>(), r.grad.data(), static_cast<float*>(ptr(r.state0)),
              static_cast<float*>(ptr(r.state1)), ptr(r.param_copy), r.param.numel(), 0, r.param_group, 0};
  constexpr int kPack = CudaPack4Ops::width;
  bool packed = aligned(d.param, kPack * 4) && aligned(d.grad, kPack * dtype_size(r.grad.dtype()));
  for (const Tensor* t : {&r.state0, &r.state1, &r.param_copy}) {
    if (is_given(*t)) packed = packed && aligned(t->data(), kPack * dtype_size(t->dtype()));
  }
  d.packed = packed;
  return d;
}

// Launches once per grad/copy dtype combination present in `runs`, which
// the caller has checked.
template <class Update, class Coefs>
void update_runs(const std::vector<Coefs>& coef_list, const std::vector<FlatRun>& runs, const float* skip_if,
                 int device, void* stream) {
  CoefTable<Coefs> coefs{};
  std::copy(coef_list.begin(), coef_list.end(), coefs.param_group);

  // Runs by (grad dtype, copy dtype or -1 for none), empty ones dropped.
  std::map<std::pair<int, int>, std::vector<DeviceRun>> by_dtypes;
  for (const FlatRun& r : runs) {
    if (r.param.numel() == 0) continue;
    const int copy = is_given(r.param_copy) ? int(r.param_copy.dtype()) : -1;
    by_dtypes[{int(r.grad.dtype()), copy}].push_back(device_run(r));
  }
  if (by_dtypes.empty()) return;  // nothing to update: no CUDA call at all
  cuda_detail::DeviceGuard guard(device);
  auto* cu_stream = static_cast<cudaStream_t>(stream);
  for (auto& entry : by_dtypes) {
    const int copy_dtype = entry.first.second;
    std::vector<DeviceRun>& table = entry.second;
    kernels::with_element_type(DType(entry.first.first), [&](auto g_type) {
      using G = decltype(g_type);
      if (copy_dtype < 0) {
        launch<Update, G, kernels::NoCopy>(coefs, std::move(table), skip_if, device, cu_stream);
      } else {
        kernels::with_element_type(DType(copy_dtype), [&](auto c_type) {
          launch<Update, G, decltype(c_type)>(coefs, std::move(table), skip_if, device, cu_stream);
        });
      }
    });
  }
}

// Everything on the first run's param's device; when that is not a CUDA
// tensor, the checks report it as a device mismatch.
Device device_of(const std::vector<FlatRun>& runs) {
  return Device{DeviceType::kCUDA, runs.empty() ? 0 : runs[0].param.device().index};
}

void check_group_count(const char* op, size_t groups) {
  if (groups > size_t(kMaxGroups)) {
    throw InvalidArgument(std::string(op) + ": " + std::to_string(groups) + " param groups, at most " +
                          std::to_string(kMaxGroups) + " per call on CUDA; update the runs in several calls");
  }
}

}  // namespace

void cuda_adam_update_runs(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                           const std::vector<FlatRun>& runs, void* stream, const float* skip_if) {
  check_group_count("adam_", groups.size());
  const Device device = device_of(runs);
  check_adam_runs(device, groups.size(), runs);
  std::vector<AdamCoefs> coefs;
  for (const AdamOptions& o : groups) coefs.push_back(adam_coefs(o, step, grad_scale));
  update_runs<AdamAt>(coefs, runs, skip_if, device.index, stream);
}

void cuda_sgd_update_runs(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                          const std::vector<FlatRun>& runs, void* stream, const float* skip_if) {
  check_group_count("sgd_", groups.size());
  const Device device = device_of(runs);
  check_sgd_runs(device, groups, runs);
  std::vector<SgdCoefs> coefs;
  for (const SgdOptions& o : groups) coefs.push_back(sgd_coefs(o, step, grad_scale));
  update_runs<SgdAt>(coefs, runs, skip_if, device.index, stream);
}

void cuda_adam_update(const AdamOptions& options, int64_t step, double grad_scale, const Tensor& param,
                      const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const Tensor& param_copy, void* stream) {
  cuda_adam_update_runs({options}, step, grad_scale, {FlatRun{0, param, grad, exp_avg, exp_avg_sq, param_copy}},
                        stream);
}

void cuda_sgd_update(const SgdOptions& options, int64_t step, double grad_scale, const Tensor& param,
                     const Tensor& grad, const Tensor& momentum_buffer, const Tensor& param_copy, void* stream) {
  cuda_sgd_update_runs({options}, step, grad_scale, {FlatRun{0, param, grad, momentum_buffer, Tensor(), param_copy}},
                       stream);
}

}  // namespace zerocore
