// The offloaded step against the same work done in plain calls: grads
// copied down, one multi-run update, params copied up, bit for bit; copies
// held back until asked for; grads copied down only once the update that
// reads them is done; swapped grad buffers instead of copies; bad input
// refused before anything is queued.
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "flat_run_helpers.h"
#include "zerocore/zerocore.h"

using namespace zerocore;
using namespace zerocore::test;

namespace {

std::mt19937 rng(5);

Tensor zeros(int64_t n, DType dtype) {
  Tensor t = Tensor::empty({n}, dtype);
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

// A partition in three buckets: on the "device" bf16 grads and params, on
// the host an fp32 master, moments, bf16 grads and the bf16 copy of the
// new params. Large enough that an update outlasts queueing the next copy.
struct Partition {
  std::vector<Tensor> device_grads, device_params;
  std::vector<OffloadBucket> buckets;

  Partition() {
    for (int64_t n : {70000, 4099, 300000}) {
      Tensor grad = random_tensor(rng, n, DType::kBFloat16), param = zeros(n, DType::kBFloat16);
      FlatRun run{0, random_tensor(rng, n, DType::kFloat32), zeros(n, DType::kBFloat16), zeros(n, DType::kFloat32),
                  zeros(n, DType::kFloat32), zeros(n, DType::kBFloat16)};
      device_grads.push_back(grad);
      device_params.push_back(param);
      buckets.push_back(OffloadBucket{{run}, {TensorCopy{grad, run.grad}}, {TensorCopy{run.param_copy, param}}});
    }
  }
  // Independent copies of the host runs, for the plain calls.
  std::vector<FlatRun> runs_copy() const {
    std::vector<FlatRun> out;
    for (const OffloadBucket& b : buckets) {
      out.push_back(copy_of(b.runs[0]));
      out.back().grad = copy_of(b.runs[0].grad);  // copy_of shares a run's grad
    }
    return out;
  }
};

AdamOptions adam_options() {
  AdamOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1;
  return o;
}

void test_step_equals_plain_calls() {
  Partition part;
  std::vector<FlatRun> plain = part.runs_copy();
  OffloadOptimizer offload(part.buckets);
  for (int64_t step = 1; step <= 3; ++step) {
    offload.copy_grads();
    offload.wait();
    std::vector<Tensor> grads;
    for (size_t i = 0; i < plain.size(); ++i) {
      std::memcpy(plain[i].grad.data(), part.device_grads[i].data(), plain[i].grad.nbytes());
      grads.push_back(plain[i].grad);
    }
    CHECK(offload.grad_sum_of_squares() == sum_of_squares(grads));
    offload.adam({adam_options()}, step, 0.5, /*copy_params=*/true);
    adam_update_runs({adam_options()}, step, 0.5, plain);
    offload.wait();
    CHECK(!offload.busy());
  }
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(same(part.buckets[i].runs[0], plain[i]));
    CHECK(same(part.device_params[i], plain[i].param_copy));
  }
}

void test_held_copies_wait_for_copy_params() {
  Partition part;
  OffloadOptimizer offload(part.buckets);
  offload.copy_grads();
  offload.sgd({SgdOptions{}}, 1, 1.0, /*copy_params=*/false);
  offload.wait();
  const Tensor untouched = zeros(part.device_params[0].numel(), DType::kBFloat16);
  CHECK(same(part.device_params[0], untouched));
  offload.copy_params();
  offload.wait();
  for (size_t i = 0; i < part.buckets.size(); ++i) CHECK(same(part.device_params[i], part.buckets[i].runs[0].param_copy));
}

void test_grads_go_down_after_the_update_reading_them() {
  Partition part;
  std::vector<FlatRun> plain = part.runs_copy();
  OffloadOptimizer offload(part.buckets);
  offload.copy_grads();
  offload.wait();
  for (size_t i = 0; i < plain.size(); ++i) {
    std::memcpy(plain[i].grad.data(), part.device_grads[i].data(), plain[i].grad.nbytes());
  }
  offload.adam({adam_options()}, 1, 1.0, false);
  // The next step's grads, copied down while the update may still run.
  std::vector<Tensor> next;
  for (const Tensor& g : part.device_grads) {
    Tensor n = random_tensor(rng, g.numel(), DType::kBFloat16);
    std::memcpy(g.data(), n.data(), g.nbytes());
    next.push_back(n);
  }
  offload.copy_grads();
  offload.wait();
  adam_update_runs({adam_options()}, 1, 1.0, plain);
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(same(part.buckets[i].runs[0].param, plain[i].param));  // updated with the old grads
    CHECK(same(part.buckets[i].runs[0].grad, next[i]));
  }
}

// The delayed update's double buffer: reduction writes the spare grads
// while the update reads the others; swap_grads trades them with no copy.
void test_swapped_grads_feed_the_update_without_a_copy() {
  Partition part;
  std::vector<Tensor> reading, filling;  // per bucket: the grads an update reads, those backward fills
  for (OffloadBucket& b : part.buckets) {
    b.grads_down.clear();
    b.spare_grads = {zeros(b.runs[0].grad.numel(), DType::kBFloat16)};
    reading.push_back(b.runs[0].grad);
    filling.push_back(b.spare_grads[0]);
  }
  std::vector<FlatRun> plain = part.runs_copy();
  OffloadOptimizer offload(part.buckets);
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<Tensor> grads;  // this step's backward
    for (size_t i = 0; i < plain.size(); ++i) {
      const Tensor g = random_tensor(rng, filling[i].numel(), DType::kBFloat16);
      std::memcpy(filling[i].data(), g.data(), g.nbytes());
      std::memcpy(plain[i].grad.data(), g.data(), g.nbytes());
      grads.push_back(g);
    }
    offload.wait();
    offload.swap_grads();
    std::swap(reading, filling);
    CHECK(offload.grad_sum_of_squares() == sum_of_squares(grads));
    offload.adam({adam_options()}, step, 0.5, /*copy_params=*/false);
    adam_update_runs({adam_options()}, step, 0.5, plain);
    for (const Tensor& f : filling) std::memset(f.data(), 0xff, f.nbytes());  // the next backward, meanwhile: NaNs
  }
  offload.wait();
  for (size_t i = 0; i < plain.size(); ++i) CHECK(same(part.buckets[i].runs[0].param, plain[i].param));
  bool threw = false;
  try {
    std::vector<OffloadBucket> bad = part.buckets;
    bad[0].spare_grads[0] = zeros(3, DType::kBFloat16);
    OffloadOptimizer refused(bad);
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
}

void test_bad_input_is_refused_up_front() {
  Partition part;
  bool threw = false;
  try {
    std::vector<OffloadBucket> bad = part.buckets;
    bad[1].params_up[0].dst = zeros(5, DType::kBFloat16);
    OffloadOptimizer offload(bad);
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
  OffloadOptimizer offload(part.buckets);
  const std::vector<FlatRun> before = part.runs_copy();
  AdamOptions negative = adam_options();
  negative.lr = -1;
  threw = false;
  try {
    offload.adam({negative}, 1, 1.0, true);
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    offload.adam({}, 1, 1.0, true);  // the runs are in group 0, and no group was given
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
  offload.wait();
  for (size_t i = 0; i < before.size(); ++i) CHECK(same(part.buckets[i].runs[0], before[i]));
}

}  // namespace

int main() {
  test_step_equals_plain_calls();
  test_held_copies_wait_for_copy_params();
  test_grads_go_down_after_the_update_reading_them();
  test_swapped_grads_feed_the_update_without_a_copy();
  test_bad_input_is_refused_up_front();
  return finish("test_offload");
}
