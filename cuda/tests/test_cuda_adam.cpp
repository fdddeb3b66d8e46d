// C++ tests of the CUDA Adam update, without torch.
//   test_cuda_adam args  argument checks, which run before any CUDA call and
//                        so pass on machines without a GPU or driver;
//   test_cuda_adam gpu   the kernel against the CPU adam_update, bit for bit
//                        (both paths perform the same IEEE operations);
//                        exits 77 (ctest: skipped) without a device.
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
#include "zerocore/cuda_optim.h"
#include "zerocore/error.h"
#include "zerocore/half.h"

using namespace zerocore;

namespace {

int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

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

void fill(const Tensor& t, std::mt19937& rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = dist(rng);
    switch (t.dtype()) {
      case DType::kFloat32: t.data_as<float>()[i] = x; break;
      case DType::kBFloat16: t.data_as<uint16_t>()[i] = float_to_bf16(x); break;
      case DType::kFloat16: t.data_as<uint16_t>()[i] = float_to_fp16(x); break;
    }
  }
}

void test_gpu_case(int64_t n, DType grad_dtype, int copy_kind, bool adamw, int64_t offset) {
  std::mt19937 rng(unsigned(n * 31 + int(grad_dtype) * 7 + copy_kind * 3 + adamw + offset));
  AdamOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  o.adamw = adamw;
  const double grad_scale = 0.37;
  const bool has_copy = copy_kind != 0;
  const DType copy_dtype = copy_kind == 1 ? DType::kBFloat16 : DType::kFloat16;

  Tensor hp = Tensor::empty({n}, DType::kFloat32), hm = Tensor::empty({n}, DType::kFloat32),
         hv = Tensor::empty({n}, DType::kFloat32), hg = Tensor::empty({n}, grad_dtype);
  Tensor hc = has_copy ? Tensor::empty({n}, copy_dtype) : Tensor();
  fill(hp, rng, 1.0f);
  std::memset(hm.data(), 0, hm.nbytes());
  std::memset(hv.data(), 0, hv.nbytes());
  Tensor dp = device_tensor(n, DType::kFloat32, offset), dm = device_tensor(n, DType::kFloat32, offset),
         dv = device_tensor(n, DType::kFloat32, offset), dg = device_tensor(n, grad_dtype, offset);
  Tensor dc = has_copy ? device_tensor(n, copy_dtype, offset) : Tensor();
  to_device(dp, hp);
  to_device(dm, hm);
  to_device(dv, hv);

  for (int64_t step = 1; step <= 5; ++step) {
    fill(hg, rng, step == 3 ? 1e-6f : 1.0f);  // one step of tiny gradients: eps matters
    to_device(dg, hg);
    adam_update(o, step, grad_scale, hp, hg, hm, hv, hc);
    cuda_adam_update(o, step, grad_scale, dp, dg, dm, dv, dc, nullptr);
  }
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const bool ok = same_bits(hp, dp) && same_bits(hm, dm) && same_bits(hv, dv) &&
                  (!has_copy || same_bits(hc, dc));
  if (!ok) {
    std::fprintf(stderr, "mismatch: n=%lld grad=%s copy=%d adamw=%d offset=%lld\n", (long long)n,
                 dtype_name(grad_dtype), copy_kind, int(adamw), (long long)offset);
    ++failures;
  }
}

void test_gpu() {
  for (int64_t n : {1, 3, 7, 4096, 1000003})
    for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (int copy_kind : {0, 1, 2})
        for (bool adamw : {true, false})
          for (int64_t offset : {0, 1}) test_gpu_case(n, g, copy_kind, adamw, offset);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "args";
  if (mode == "args") {
    test_args();
  } else if (mode == "gpu") {
    if (cuda_device_count() == 0) {
      std::printf("no CUDA device: skipped\n");
      return 77;
    }
    test_gpu();
  } else {
    std::fprintf(stderr, "usage: %s [args|gpu]\n", argv[0]);
    return 2;
  }
  if (failures) std::fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
