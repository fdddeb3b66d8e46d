// C++ tests of the CUDA kernels, without torch.
//   test_cuda_kernels args  argument checks, which run before any CUDA call
//                           and so pass on machines without a GPU or driver;
//   test_cuda_kernels gpu   Adam, AdamW and SGD over several runs and groups
//                           in one call, accumulate and fill, against the CPU
//                           kernels bit for bit (both instantiate
//                           kernels/element_math.h), for every dtype
//                           combination, aligned and not; exits 77 (ctest:
//                           skipped) without a device.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/cuda_elementwise.h"
#include "zerocore/cuda_optim.h"
#include "zerocore/kernels/cpu_accumulate.h"
#include "zerocore/kernels/cpu_fill.h"
#include "zerocore/kernels/element_math.h"
#include "zerocore/error.h"
#include "zerocore/half.h"
#include "test_modes.h"

using namespace zerocore;

namespace {

using cuda_tests::failures;

template <typename E>
bool throws(const std::function<void()>& f) {
  try {
    f();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

// A tensor on cuda:0 whose memory is never touched: enough for checks that
// only read dtype, device and size.
Tensor fake_cuda(int64_t n, DType dtype) {
  static char dummy[16];
  return Tensor(dummy, dtype, Device{DeviceType::kCUDA, 0}, {n}, std::shared_ptr<void>(dummy, [](void*) {}));
}

void test_args() {
  CHECK(cuda_device_count() >= 0);  // never throws, 0 without a driver
  const AdamOptions o;
  const Tensor p = fake_cuda(8, DType::kFloat32), g = fake_cuda(8, DType::kBFloat16);
  const Tensor m = fake_cuda(8, DType::kFloat32), v = fake_cuda(8, DType::kFloat32);
  auto run = [&](const AdamOptions& opt, int64_t step, const Tensor& pp, const Tensor& gg,
                 const Tensor& mm, const Tensor& copy) {
    return [=] { cuda_adam_update(opt, step, 1.0, pp, gg, mm, v, copy, nullptr); };
  };
  const Tensor host_p = Tensor::empty({8}, DType::kFloat32);
  CHECK(throws<TypeMismatch>(run(o, 1, host_p, g, m, Tensor())));             // param on the CPU
  CHECK(throws<TypeMismatch>(run(o, 1, fake_cuda(8, DType::kFloat16), g, m, Tensor())));
  CHECK(throws<TypeMismatch>(run(o, 1, p, g, fake_cuda(8, DType::kBFloat16), Tensor())));
  CHECK(throws<TypeMismatch>(run(o, 1, p, g, m, fake_cuda(8, DType::kFloat32))));
  CHECK(throws<InvalidArgument>(run(o, 1, p, fake_cuda(7, DType::kFloat32), m, Tensor())));
  CHECK(throws<InvalidArgument>(run(o, 1, p, g, m, fake_cuda(9, DType::kFloat16))));
  CHECK(throws<InvalidArgument>(run(o, 0, p, g, m, Tensor())));  // step counts from 1
  AdamOptions bad = o;
  bad.beta1 = 1.0;
  CHECK(throws<InvalidArgument>(run(bad, 1, p, g, m, Tensor())));
  bad = o;
  bad.lr = -1.0;
  CHECK(throws<InvalidArgument>(run(bad, 1, p, g, m, Tensor())));
  CHECK(throws<InvalidArgument>([&] {
    cuda_adam_update(o, 1, HUGE_VAL, p, g, m, v, Tensor(), nullptr);
  }));
  // An empty partition is valid and launches nothing.
  const Tensor e = fake_cuda(0, DType::kFloat32);
  cuda_adam_update(o, 1, 1.0, e, e, e, e, Tensor(), nullptr);
  // Runs: a group index without options, too many groups, a second device.
  const FlatRun other_group{1, p, g, m, v, Tensor()};
  CHECK(throws<InvalidArgument>([&] { cuda_adam_update_runs({o}, 1, 1.0, {other_group}, nullptr); }));
  CHECK(throws<InvalidArgument>(
      [&] { cuda_adam_update_runs(std::vector<AdamOptions>(33), 1, 1.0, {FlatRun{0, e, e, e, e, Tensor()}}, nullptr); }));
  const Tensor on_1(p.data(), DType::kFloat32, Device{DeviceType::kCUDA, 1}, {8}, nullptr);
  CHECK(throws<TypeMismatch>(
      [&] { cuda_adam_update_runs({o, o}, 1, 1.0, {FlatRun{0, e, e, e, e, Tensor()}, FlatRun{1, on_1, g, m, v, Tensor()}}, nullptr); }));
  // SGD: momentum needs its buffer.
  SgdOptions sgd;
  sgd.momentum = 0.9;
  CHECK(throws<InvalidArgument>([&] { cuda_sgd_update(sgd, 1, 1.0, p, g, Tensor(), Tensor(), nullptr); }));
  sgd.momentum = 0.0;
  cuda_sgd_update(sgd, 1, 1.0, e, e, Tensor(), Tensor(), nullptr);
  // Accumulate and fill: one device, equal sizes; empty launches nothing.
  CHECK(throws<TypeMismatch>([&] { cuda_accumulate(p, host_p, nullptr); }));
  CHECK(throws<InvalidArgument>([&] { cuda_accumulate(p, fake_cuda(7, DType::kFloat32), nullptr); }));
  CHECK(throws<TypeMismatch>([&] { cuda_fill(host_p, 1.0f, nullptr); }));
  // Int64 sums (Config(deterministic=True)) take int64 elements only.
  CHECK(throws<TypeMismatch>([&] { cuda_accumulate(fake_cuda(8, DType::kInt64), p, nullptr); }));
  CHECK(throws<TypeMismatch>([&] { cuda_accumulate(p, fake_cuda(8, DType::kInt64), nullptr); }));
  cuda_accumulate(e, e, nullptr);
  cuda_fill(e, 1.0f, nullptr);
}

void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// A device buffer of n elements starting `offset` elements into its
// allocation (offset 1 defeats the 16-byte vector path).
Tensor device_tensor(int64_t n, DType dtype, int64_t offset) {
  void* ptr = nullptr;
  cuda_ok(cudaMalloc(&ptr, size_t(n + offset) * dtype_size(dtype) + 16), "cudaMalloc");
  Tensor whole(ptr, dtype, Device{DeviceType::kCUDA, 0}, {n + offset},
               std::shared_ptr<void>(ptr, [](void* q) { cudaFree(q); }));
  return whole.slice(offset, n);
}

void to_device(const Tensor& dst, const Tensor& src) {
  cuda_ok(cudaMemcpy(dst.data(), src.data(), src.nbytes(), cudaMemcpyHostToDevice), "H2D");
}

bool same_bits(const Tensor& host, const Tensor& dev) {
  std::vector<unsigned char> back(dev.nbytes());
  cuda_ok(cudaMemcpy(back.data(), dev.data(), dev.nbytes(), cudaMemcpyDeviceToHost), "D2H");
  return std::memcmp(back.data(), host.data(), host.nbytes()) == 0;
}

void randomize(const Tensor& t, std::mt19937& rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = dist(rng);
    switch (t.dtype()) {
      case DType::kFloat32: t.data_as<float>()[i] = x; break;
      case DType::kBFloat16: t.data_as<uint16_t>()[i] = float_to_bf16(x); break;
      case DType::kFloat16: t.data_as<uint16_t>()[i] = float_to_fp16(x); break;
      case DType::kInt64: t.data_as<int64_t>()[i] = int64_t(x); break;  // stddev large: past 2**53
      case DType::kInt40: {  // packed, 5 bytes an element
        uint8_t* element = static_cast<uint8_t*>(t.data()) + 5 * i;
        std::memset(element, 0, 5);
        kernels::add_to_int40(element, int64_t(x));
        break;
      }
    }
  }
}

// One array of a run on both sides: host and device hold the same start.
struct Pair {
  Tensor host, dev;
};

Pair pair(int64_t n, DType dtype, int64_t offset, std::mt19937& rng, float stddev) {
  Pair x{Tensor::empty({n}, dtype), device_tensor(n, dtype, offset)};
  randomize(x.host, rng, stddev);
  to_device(x.dev, x.host);
  return x;
}

// Runs of several lengths (one spanning many chunks), in two groups, some at
// odd offsets (no packed access), updated for five steps in one call each;
// the CUDA result must equal the CPU's bit for bit.
void test_gpu_case(bool sgd, DType grad_dtype, int copy_kind, bool variant) {
  std::mt19937 rng(unsigned(int(grad_dtype) * 7 + copy_kind * 3 + variant + 11 * sgd));
  const DType copy_dtype = copy_kind == 1 ? DType::kBFloat16 : DType::kFloat16;
  const double grad_scale = 0.37;
  struct RunPairs {
    Pair p, g, s0, s1, c;
  };
  std::vector<RunPairs> pairs;
  std::vector<FlatRun> host_runs, dev_runs;
  const int64_t lengths[] = {1, 3, 4096 + 5, 1000003, 7};
  for (int k = 0; k < 5; ++k) {
    const int64_t n = lengths[k], offset = k % 2;
    RunPairs r{pair(n, DType::kFloat32, offset, rng, 1.0f), pair(n, grad_dtype, offset, rng, 1.0f),
               pair(n, DType::kFloat32, offset, rng, 0.1f), pair(n, DType::kFloat32, offset, rng, 0.0f), {}};
    if (copy_kind != 0) r.c = pair(n, copy_dtype, offset, rng, 1.0f);
    if (!sgd) {  // exp_avg_sq starts at zero
      std::memset(r.s1.host.data(), 0, r.s1.host.nbytes());
      to_device(r.s1.dev, r.s1.host);
    }
    pairs.push_back(r);
    host_runs.push_back(FlatRun{k % 2, r.p.host, r.g.host, r.s0.host, sgd ? Tensor() : r.s1.host, r.c.host});
    dev_runs.push_back(FlatRun{k % 2, r.p.dev, r.g.dev, r.s0.dev, sgd ? Tensor() : r.s1.dev, r.c.dev});
  }
  for (int64_t step = 1; step <= 5; ++step) {
    for (RunPairs& r : pairs) {  // one step of tiny gradients: eps matters
      randomize(r.g.host, rng, step == 3 ? 1e-6f : 1.0f);
      to_device(r.g.dev, r.g.host);
    }
    if (sgd) {
      SgdOptions a, b;
      a.lr = 1e-2;
      a.momentum = 0.9;
      a.dampening = 0.1;
      a.weight_decay = 0.1;
      b.lr = 3e-2;
      b.nesterov = !variant;
      b.momentum = variant ? 0.0 : 0.8;  // the variant: no momentum at all
      sgd_update_runs({a, b}, step, grad_scale, host_runs);
      cuda_sgd_update_runs({a, b}, step, grad_scale, dev_runs, nullptr);
    } else {
      AdamOptions a, b;
      a.lr = 1e-2;
      a.weight_decay = 0.1;
      a.adamw = variant;
      b.lr = 3e-3;
      b.beta1 = 0.8;
      b.adamw = !variant;
      adam_update_runs({a, b}, step, grad_scale, host_runs);
      cuda_adam_update_runs({a, b}, step, grad_scale, dev_runs, nullptr);
    }
  }
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (size_t k = 0; k < pairs.size(); ++k) {
    const RunPairs& r = pairs[k];
    const bool ok = same_bits(r.p.host, r.p.dev) && same_bits(r.s0.host, r.s0.dev) &&
                    (sgd || same_bits(r.s1.host, r.s1.dev)) && (copy_kind == 0 || same_bits(r.c.host, r.c.dev));
    if (!ok) {
      std::fprintf(stderr, "mismatch: %s run=%zu grad=%s copy=%d variant=%d\n", sgd ? "sgd" : "adam", k,
                   dtype_name(grad_dtype), copy_kind, int(variant));
      ++failures;
    }
  }
}

// accumulate and fill on both sides from the same start, offset 1 taking
// the element-by-element path; int64 (exact sums) as integers.
void test_gpu_elementwise(DType dst_dtype, DType src_dtype, int64_t offset) {
  std::mt19937 rng(unsigned(int(dst_dtype) * 5 + int(src_dtype) * 3 + offset));
  const int64_t n = 1000003;
  const float stddev = dst_dtype == DType::kInt64 ? 1e17f : 1.0f;
  Pair dst = pair(n, dst_dtype, offset, rng, stddev), src = pair(n, src_dtype, offset, rng, stddev);
  accumulate(dst.host, src.host);
  cuda_accumulate(dst.dev, src.dev, nullptr);
  Pair filled = pair(n, src_dtype, offset, rng, stddev);
  const float value = std::normal_distribution<float>()(rng);
  fill(filled.host, value);
  cuda_fill(filled.dev, value, nullptr);
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (!same_bits(dst.host, dst.dev) || !same_bits(filled.host, filled.dev)) {
    std::fprintf(stderr, "mismatch: accumulate/fill dst=%s src=%s offset=%lld\n", dtype_name(dst_dtype),
                 dtype_name(src_dtype), (long long)offset);
    ++failures;
  }
}

void test_gpu() {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    for (DType s : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (int64_t offset : {0, 1}) test_gpu_elementwise(d, s, offset);
  for (int64_t offset : {0, 1}) test_gpu_elementwise(DType::kInt64, DType::kInt64, offset);
  for (bool sgd : {false, true})
    for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (int copy_kind : {0, 1, 2})
        for (bool variant : {true, false}) test_gpu_case(sgd, g, copy_kind, variant);
}

}  // namespace

int main(int argc, char** argv) { return cuda_tests::run_mode(argc, argv, test_args, test_gpu); }
