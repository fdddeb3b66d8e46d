// Multi-run steps against one call per run (bit for bit: the same kernels on
// the same elements), and the fp64 sum of squares against a plain loop.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "flat_run_helpers.h"
#include "zerocore/zerocore.h"

using namespace zerocore;
using namespace zerocore::test;

namespace {

std::mt19937 rng(11);

// Runs of several lengths (a cache line, less, more, odd), grads of every
// dtype, two groups, with and without a 16-bit copy.
std::vector<FlatRun> make_runs(bool with_state1) {
  std::vector<FlatRun> runs;
  const int64_t lengths[] = {1, 64, 17, 1000, 4099};
  const DType grads[] = {DType::kBFloat16, DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  for (int i = 0; i < 5; ++i) {
    const int64_t n = lengths[i];
    Tensor s0 = Tensor::empty({n}, DType::kFloat32), s1 = Tensor::empty({n}, DType::kFloat32);
    std::memset(s0.data(), 0, s0.nbytes());
    std::memset(s1.data(), 0, s1.nbytes());
    runs.push_back(FlatRun{i % 2, random_tensor(rng, n, DType::kFloat32), random_tensor(rng, n, grads[i]), s0,
                           with_state1 ? s1 : Tensor(), i % 3 ? Tensor::empty({n}, DType::kBFloat16) : Tensor()});
  }
  return runs;
}

void test_adam_runs() {
  AdamOptions a, b;
  a.lr = 1e-2, a.weight_decay = 0.1;
  b.lr = 3e-3, b.beta1 = 0.8, b.adamw = false, b.weight_decay = 0.01;
  std::vector<FlatRun> together = make_runs(true), alone;
  for (const FlatRun& r : together) alone.push_back(copy_of(r));
  for (int64_t step = 1; step <= 3; ++step) {
    adam_update_runs({a, b}, step, 0.5, together);
    for (const FlatRun& r : alone) {
      adam_update(r.param_group ? b : a, step, 0.5, r.param, r.grad, r.state0, r.state1, r.param_copy);
    }
  }
  for (size_t i = 0; i < together.size(); ++i) CHECK(same(together[i], alone[i]));
}

void test_sgd_runs() {
  SgdOptions a, b;
  a.lr = 0.1, a.momentum = 0.9, a.nesterov = true;
  b.lr = 0.05, b.weight_decay = 0.01;  // no momentum: its runs need no buffer
  std::vector<FlatRun> together = make_runs(false), alone;
  for (FlatRun& r : together) {
    if (r.param_group == 1) r.state0 = Tensor();
  }
  for (const FlatRun& r : together) alone.push_back(copy_of(r));
  for (int64_t step = 1; step <= 3; ++step) {
    sgd_update_runs({a, b}, step, 2.0, together);
    for (const FlatRun& r : alone) {
      sgd_update(r.param_group ? b : a, step, 2.0, r.param, r.grad, r.state0, r.param_copy);
    }
  }
  for (size_t i = 0; i < together.size(); ++i) CHECK(same(together[i], alone[i]));
}

void test_bad_runs_write_nothing() {
  std::vector<FlatRun> runs = make_runs(true);
  const Tensor before = copy_of(runs[0].param);
  bool caught = false;
  try {
    adam_update_runs({AdamOptions{}}, 1, 1.0, runs);  // runs of group 1 have no options
  } catch (const InvalidArgument&) {
    caught = true;
  }
  CHECK(caught && same(runs[0].param, before));
  runs[3].state1 = Tensor::empty({3}, DType::kFloat32);  // a wrong size in one run
  caught = false;
  try {
    adam_update_runs({AdamOptions{}, AdamOptions{}}, 1, 1.0, runs);
  } catch (const InvalidArgument&) {
    caught = true;
  }
  CHECK(caught && same(runs[0].param, before));
}

void test_sum_of_squares() {
  std::vector<Tensor> xs = {random_tensor(rng, 1, DType::kFloat32), random_tensor(rng, 4099, DType::kBFloat16),
                            random_tensor(rng, 100, DType::kFloat16), random_tensor(rng, 70000, DType::kFloat32)};
  double expected = 0.0;
  for (const Tensor& t : xs) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      double x = t.dtype() == DType::kFloat32    ? t.data_as<float>()[i]
                 : t.dtype() == DType::kBFloat16 ? bf16_to_float(t.data_as<uint16_t>()[i])
                                                 : fp16_to_float(t.data_as<uint16_t>()[i]);
      expected += x * x;
    }
  }
  const double got = sum_of_squares(xs);
  CHECK(std::fabs(got - expected) <= 1e-12 * expected);
  CHECK(sum_of_squares(xs) == got);  // the same bits every call
  CHECK(sum_of_squares({}) == 0.0);
  xs[2].data_as<uint16_t>()[50] = 0x7C00;  // fp16 +inf
  CHECK(std::isinf(sum_of_squares(xs)));
  xs[3].data_as<float>()[123] = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(sum_of_squares(xs)));
}

// Several threads stepping their own runs at once on the shared pool (ranks
// as threads, or Python threads: the bindings release the GIL) take turns;
// each gets what it would alone.
void test_concurrent_callers() {
  std::vector<std::vector<FlatRun>> mine(3), alone(3);
  for (size_t t = 0; t < mine.size(); ++t) {
    mine[t] = make_runs(true);
    for (const FlatRun& r : mine[t]) alone[t].push_back(copy_of(r));
  }
  AdamOptions a, b;
  b.lr = 3e-3;
  for (auto& runs : alone) {
    for (int64_t step = 1; step <= 20; ++step) adam_update_runs({a, b}, step, 1.0, runs);
  }
  std::vector<std::thread> threads;
  for (auto& runs : mine) {
    threads.emplace_back([&runs, a, b] {
      for (int64_t step = 1; step <= 20; ++step) adam_update_runs({a, b}, step, 1.0, runs);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t t = 0; t < mine.size(); ++t) {
    for (size_t i = 0; i < mine[t].size(); ++i) CHECK(same(mine[t][i], alone[t][i]));
  }
}

}  // namespace

int main() {
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    test_adam_runs();
    test_sgd_runs();
    test_bad_runs_write_nothing();
    test_sum_of_squares();
    test_concurrent_callers();
  }
  return test::finish("test_flat_runs");
}
