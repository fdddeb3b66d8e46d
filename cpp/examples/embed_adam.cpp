// Embedding zerocore in a C++ trainer: plan a flat buffer for two params,
// allocate the partition and state from arenas, and run AdamW steps with a
// bf16 copy of the updated params. Prints the params before and after, and
// checks every element against AdamW written out in double (plain scalar
// code, no zerocore): exits non-zero if they disagree.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "zerocore/zerocore.h"

namespace {

// Round-to-nearest-even of a float to bf16's 16 bits (finite values).
uint16_t to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace

int main() {
  using namespace zerocore;
  // Two params (3x5 and 7 elements) on one rank, 16-element alignment.
  const LayoutPlan plan = LayoutPlan::make({{15, 0}, {7, 0}}, LayoutOptions{1, 16, 0});
  const int64_t n = plan.partition_elems();
  constexpr int kSteps = 3;

  auto fp32 = HostArena::create(size_t(n) * 4 * 4);  // param, grad, exp_avg, exp_avg_sq
  Tensor param = fp32->view(0, DType::kFloat32, {n});
  Tensor grad = fp32->view(size_t(n) * 4, DType::kFloat32, {n});
  Tensor exp_avg = fp32->view(size_t(n) * 8, DType::kFloat32, {n});
  Tensor exp_avg_sq = fp32->view(size_t(n) * 12, DType::kFloat32, {n});
  Tensor copy = Tensor::empty({n}, DType::kBFloat16);
  // The gradient of element i at step s: signs and sizes that change from step to step.
  auto grad_at = [](int64_t i, int s) { return float((i % 2 ? 1.0 : -1.0) * (0.5 + 0.25 * double((i + s) % 3))); };
  for (int64_t i = 0; i < n; ++i) {
    param.data_as<float>()[i] = 0.01f * float(i);
    exp_avg.data_as<float>()[i] = exp_avg_sq.data_as<float>()[i] = 0.0f;
  }
  AdamOptions opt;
  opt.lr = 0.1;
  opt.weight_decay = 0.01;
  for (int step = 1; step <= kSteps; ++step) {
    for (int64_t i = 0; i < n; ++i) grad.data_as<float>()[i] = grad_at(i, step);
    adam_update(opt, step, /*grad_scale=*/1.0, param, grad, exp_avg, exp_avg_sq, copy);
  }

  std::printf("isa=%s threads=%d buffer=%lld elements (%lld padding), %d AdamW steps\n", isa_name(active_isa()),
              num_threads(), (long long)plan.total_elems(), (long long)plan.padding_elems(), kSteps);
  const int64_t second = plan.params()[1].offset;
  std::printf("param[1][0]: 0.01*%lld -> %.6f (bf16 copy %.6f)\n", (long long)second,
              param.data_as<float>()[second], bf16_to_float(copy.data_as<uint16_t>()[second]));

  // AdamW in double: decoupled decay, then the bias-corrected moments' step.
  int wrong = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double p = 0.01 * double(float(i)), m = 0.0, v = 0.0;
    for (int step = 1; step <= kSteps; ++step) {
      const double g = grad_at(i, step);
      p *= 1.0 - opt.lr * opt.weight_decay;
      m = opt.beta1 * m + (1.0 - opt.beta1) * g;
      v = opt.beta2 * v + (1.0 - opt.beta2) * g * g;
      const double m_hat = m / (1.0 - std::pow(opt.beta1, step));
      const double v_hat = v / (1.0 - std::pow(opt.beta2, step));
      p -= opt.lr * m_hat / (std::sqrt(v_hat) + opt.eps);
    }
    const float got = param.data_as<float>()[i];
    const double err = std::fabs(double(got) - p);
    worst = std::max(worst, err);
    const bool copy_ok = copy.data_as<uint16_t>()[i] == to_bf16_bits(got);
    if (err > 1e-6 * (1.0 + std::fabs(p)) || !copy_ok) {
      if (wrong++ < 5) {
        std::fprintf(stderr, "element %lld: param %.8f, AdamW in double %.8f; bf16 copy %s\n", (long long)i, got, p,
                     copy_ok ? "ok" : "is not the param rounded");
      }
    }
  }
  std::printf("against AdamW in double: largest param difference %.2e, %s\n", worst, wrong ? "MISMATCH" : "ok");
  return wrong ? 1 : 0;
}
