// Embedding zerocore in a C++ trainer: plan a flat buffer for two params,
// allocate the partition and state from arenas, and run one AdamW step with
// a bf16 copy of the updated params. Prints the params before and after.
#include <cstdio>

#include "zerocore/zerocore.h"

int main() {
  using namespace zerocore;
  // Two params (3x5 and 7 elements) on one rank, 16-element alignment.
  const LayoutPlan plan = LayoutPlan::make({{15, 0}, {7, 0}}, LayoutOptions{1, 16, 0});
  const int64_t n = plan.partition_elems();

  auto fp32 = HostArena::create(size_t(n) * 4 * 4);  // param, grad, exp_avg, exp_avg_sq
  Tensor param = fp32->view(0, DType::kFloat32, {n});
  Tensor grad = fp32->view(size_t(n) * 4, DType::kFloat32, {n});
  Tensor exp_avg = fp32->view(size_t(n) * 8, DType::kFloat32, {n});
  Tensor exp_avg_sq = fp32->view(size_t(n) * 12, DType::kFloat32, {n});
  Tensor copy = Tensor::empty({n}, DType::kBFloat16);
  for (int64_t i = 0; i < n; ++i) {
    param.data_as<float>()[i] = 0.01f * float(i);
    grad.data_as<float>()[i] = i % 2 ? 1.0f : -1.0f;
    exp_avg.data_as<float>()[i] = exp_avg_sq.data_as<float>()[i] = 0.0f;
  }
  AdamOptions opt;
  opt.lr = 0.1;
  opt.weight_decay = 0.01;
  adam_update(opt, /*step=*/1, /*grad_scale=*/1.0, param, grad, exp_avg, exp_avg_sq, copy);

  std::printf("isa=%s threads=%d buffer=%lld elements (%lld padding)\n", isa_name(active_isa()),
              num_threads(), (long long)plan.total_elems(), (long long)plan.padding_elems());
  const int64_t second = plan.params()[1].offset;
  std::printf("param[1][0]: 0.01*%lld -> %.6f (bf16 copy %.6f)\n", (long long)second,
              param.data_as<float>()[second], bf16_to_float(copy.data_as<uint16_t>()[second]));
  return 0;
}
