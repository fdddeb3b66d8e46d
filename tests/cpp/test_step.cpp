// ZeroStep on thread ranks: stages 0 (grads all-reduced, every rank updates
// all), 1-2 (each rank updates its partition, then the params are gathered)
// and 3 (each rank updates its shard, nothing gathered), checked against
// the same step written out in double (SGD: the update is p - lr * scale *
// g); clipping; a non-finite grad on one rank skipping the step on every
// rank with nothing changed (dynamic loss scaling) or throwing on every rank
// (a fixed scale); the dynamic loss scale over a run of steps (growth,
// hysteresis, backoff, the error at its minimum) against the rule worked
// out by hand; late grads (after their bucket's reduction, on one rank,
// over accumulated backwards) agreed and reduced in the step's exchange;
// ranks whose collectives differ throwing on every rank before anything
// changes; the step's sum of squares and update run by its backend, on
// the compute stream, ordered under the checking backend; the step driving ZeRO-Offload's host update (HostUpdate over
// an OffloadOptimizer on the checking backend): overlapped, delayed, and a
// skipped or refused step landing the pending update.
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "thread_ranks.h"
#include "zerocore/step/host_update.h"
#include "zerocore/step/zero_step.h"
#include "zerocore/zerocore.h"

namespace zerocore {
namespace {

constexpr int kWorld = 2;
constexpr double kLr = 0.1;
const std::vector<int64_t> kNumels = {37, 64, 10};

LayoutPlan plan_of() {
  std::vector<ParamSpec> specs;
  for (int64_t n : kNumels) specs.push_back(ParamSpec{n, 0});
  return LayoutPlan::make(specs, LayoutOptions{kWorld, 4, 48});
}

// Rank r's grad values (before any reduction), the same on every thread.
std::vector<float> grads_of(int rank, int64_t n) {
  std::mt19937 rng(1234u + unsigned(rank));
  std::normal_distribution<float> normal;
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = normal(rng);
  return out;
}

float param_value(int64_t i) { return 0.25f * float(i % 17) - 1.0f; }

Tensor filled(const std::vector<float>& values) {
  Tensor t = Tensor::empty({int64_t(values.size())}, DType::kFloat32);
  std::memcpy(t.data(), values.data(), t.nbytes());
  return t;
}

StepOptions sgd(std::optional<double> max_norm = std::nullopt) {
  StepOptions o;
  o.kind = OptimizerKind::kSgd;
  o.sgd = {SgdOptions{kLr, 0.0, 0.0, 0.0, false}};
  o.max_norm = max_norm;
  return o;
}

bool close(double got, double want) { return std::abs(got - want) <= 1e-5 * (1.0 + std::abs(want)); }

// Rank r's runs of a partitioned step: bucket b's shard of `full` (at
// offset + r * shard) with its grads at the bucket's place in `grad_part`.
std::vector<FlatRun> partition_runs(const LayoutPlan& plan, int r, const Tensor& full, const Tensor& grad_part) {
  std::vector<FlatRun> runs;
  for (size_t b = 0; b < plan.buckets().size(); ++b) {
    const int64_t shard = plan.shard_elems(int(b));
    runs.push_back(FlatRun{0, full.slice(plan.buckets()[b].offset + r * shard, shard),
                           grad_part.slice(plan.partition_offset(int(b)), shard), Tensor(), Tensor(), Tensor()});
  }
  return runs;
}

enum class Stage { kZero, kOneTwo, kThree };

// One step at `stage`: checks every element each rank holds afterwards, and
// the norm, against the double reference. The grads stand for what the
// reduction left: stage 0's are each rank's own, all-reduced by the step;
// the partitioned stages' are rank r's partition of the summed grads.
void test_step(Stage stage, double loss_scale, std::optional<double> clip_fraction) {
  const LayoutPlan plan = plan_of();
  const int64_t total = plan.total_elems(), part = plan.partition_elems();
  // The reference: the summed grads of the whole flat buffer.
  std::vector<double> summed(static_cast<size_t>(total), 0.0);
  if (stage == Stage::kZero) {
    for (int r = 0; r < kWorld; ++r) {
      const std::vector<float> g = grads_of(r, total);
      for (int64_t i = 0; i < total; ++i) summed[size_t(i)] += g[size_t(i)];
    }
  }
  // Partitioned: bucket b's shard for rank r sits at offset + r * shard.
  auto owner_grads = [&](int r) { return grads_of(r, part); };
  std::vector<int> owner(static_cast<size_t>(total));
  std::vector<int64_t> at(static_cast<size_t>(total));  // where the element is in its owner's partition
  for (size_t b = 0; b < plan.buckets().size(); ++b) {
    const int64_t shard = plan.shard_elems(int(b));
    for (int r = 0; r < kWorld; ++r) {
      for (int64_t k = 0; k < shard; ++k) {
        const int64_t i = plan.buckets()[b].offset + r * shard + k;
        owner[size_t(i)] = r;
        at[size_t(i)] = plan.partition_offset(int(b)) + k;
      }
    }
  }
  if (stage != Stage::kZero) {
    for (int64_t i = 0; i < total; ++i) summed[size_t(i)] = owner_grads(owner[size_t(i)])[size_t(at[size_t(i)])];
  }
  double sum_sq = 0.0;
  for (double g : summed) sum_sq += g * g;
  double scale = 1.0 / (kWorld * loss_scale);
  const double norm = std::sqrt(sum_sq) * scale;
  const std::optional<double> max_norm =
      clip_fraction ? std::optional<double>(*clip_fraction * norm) : std::nullopt;
  if (max_norm) scale *= std::min(1.0, *max_norm / (norm + 1e-6));

  std::atomic<int> bad{0};
  test::on_ranks_with_rounds(kWorld, [&](int r, CommQueue& data, CommQueue& control) {
    std::vector<float> init(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) init[size_t(i)] = param_value(i);
    const Tensor full = filled(init);
    Tensor grad = filled(stage == Stage::kZero ? grads_of(r, total) : owner_grads(r));
    const std::vector<FlatRun> runs = stage == Stage::kZero
                                          ? std::vector<FlatRun>{FlatRun{0, full, grad, Tensor(), Tensor(), Tensor()}}
                                          : partition_runs(plan, r, full, grad);
    // Stage 0 reduces whole grads; the others hold their partition of them.
    std::optional<BucketCollectives> reduce;
    if (stage == Stage::kZero) {
      reduce.emplace(data, CollectiveKind::kAllReduce, std::vector{FlatGroupBuffer{0, plan, grad}});
    }
    BucketCollectives gather(data, CollectiveKind::kAllGather, {FlatGroupBuffer{0, plan, full}});
    LossScaler scaler(loss_scale);
    ZeroStep::Parts parts{&data, &control, runs, stage != Stage::kZero, reduce ? &*reduce : nullptr,
                          stage == Stage::kOneTwo ? &gather : nullptr};
    parts.loss_scaler = &scaler;
    ZeroStep step(std::move(parts));
    const StepResult result = step.step(sgd(max_norm));
    // Without clipping the step decides on the device and reads no norm.
    const bool norm_read = max_norm ? close(result.norm, norm) : std::isnan(result.norm);
    if (!result.applied || !norm_read || !close(result.grad_scale, scale)) ++bad;
    for (int64_t i = 0; i < total; ++i) {
      const bool mine = stage != Stage::kThree || owner[size_t(i)] == r;
      const double want = mine ? param_value(i) - kLr * scale * summed[size_t(i)] : param_value(i);
      if (!close(full.data_as<float>()[i], want)) ++bad;
    }
  });
  CHECK(bad == 0);
}

// clip_grad_norm_'s path: the exchange first, then the step, which does not
// exchange again (a second control collective on one rank only would hang);
// trainability changes on one rank refuse the step on every rank.
void test_exchange_then_step() {
  std::atomic<int> bad{0};
  test::on_ranks_with_rounds(kWorld, [&](int r, CommQueue& data, CommQueue& control) {
    const Tensor param = filled(std::vector<float>(8, 1.0f));
    const Tensor grad = filled(std::vector<float>(8, float(r + 1)));
    ZeroStep step(ZeroStep::Parts{&data, &control, {FlatRun{0, param, grad, Tensor(), Tensor(), Tensor()}}, true});
    const Exchanged& agreed = step.exchange(r == 1 ? 2 : 0);
    if (agreed.sum_of_squares != 8.0 * (1 + 4) || agreed.changes != 2) ++bad;
    if (r == 0) step.exchange();  // cached: no second collective
    // Rank 1's trainability changes: every rank refuses the step, with nothing updated.
    try {
      step.step(sgd());
      ++bad;
    } catch (const TrainabilityChanged&) {
      if (param.data_as<float>()[0] != 1.0f) ++bad;
    }
    step.forget();
    const StepResult result = step.step(sgd());  // exchanges afresh, with no changes, decided on the device
    if (!result.applied || !std::isnan(result.norm)) ++bad;
    if (step.exchanged() || !close(param.data_as<float>()[0], 1.0 - kLr * (r + 1.0) / kWorld)) ++bad;
  });
  CHECK(bad == 0);
}

// One rank's grads hold an inf. Dynamic loss scaling: every rank reports
// the step not applied, with a non-finite norm, the scale halved and
// nothing else (params, gathered buffer) changed, and the next step
// exchanges afresh. A fixed scale: every rank throws NonFiniteGradients,
// with nothing changed and the exchange kept (a second step() decides the
// same, with no second exchange) until forget().
void test_overflow_on_every_rank(bool dynamic) {
  const LayoutPlan plan = plan_of();
  std::atomic<int> bad{0}, threw{0};
  test::on_ranks_with_rounds(kWorld, [&](int r, CommQueue& data, CommQueue& control) {
    std::vector<float> init(static_cast<size_t>(plan.total_elems()));
    for (size_t i = 0; i < init.size(); ++i) init[i] = param_value(int64_t(i));
    const Tensor full = filled(init);
    std::vector<float> g = grads_of(r, plan.partition_elems());
    if (r == 1) g[3] = std::numeric_limits<float>::infinity();
    const Tensor grad = filled(g);
    const int64_t shard = plan.shard_elems(0);
    BucketCollectives gather(data, CollectiveKind::kAllGather, {FlatGroupBuffer{0, plan, full}});
    LossScaler scaler = dynamic ? LossScaler(DynamicScale{1024.0, 2000, 1, 1.0, false, false}) : LossScaler(1024.0);
    ZeroStep::Parts parts{&data, &control,
                          {FlatRun{0, full.slice(r * shard, shard), grad.slice(0, shard), Tensor(), Tensor(),
                                   Tensor()}},
                          true, nullptr, &gather};
    parts.loss_scaler = &scaler;
    ZeroStep step(std::move(parts));
    for (int attempt = 0; attempt < (dynamic ? 1 : 2); ++attempt) {
      try {
        const StepResult result = step.step(sgd(1.0));
        if (!dynamic || result.applied || std::isfinite(result.norm) || step.exchanged()) ++bad;
      } catch (const NonFiniteGradients&) {
        if (dynamic || !step.exchanged()) ++bad;
        ++threw;
      }
    }
    if (scaler.scale() != (dynamic ? 512.0 : 1024.0)) ++bad;
    step.forget();
    if (step.exchanged()) ++bad;
    if (std::memcmp(full.data(), init.data(), full.nbytes()) != 0) ++bad;
  });
  CHECK(bad == 0);
  CHECK(threw == (dynamic ? 0 : 2 * kWorld));
}

// A checking backend whose queries never find an event done: a rank whose
// device is further behind than its peers'.
class BlindBackend : public CheckingCpuBackend {
 public:
  BlindBackend(CheckingOptions options, bool blind) : CheckingCpuBackend(options), blind_(blind) {}
  bool query(const StreamEvent& event) override { return !blind_ && CheckingCpuBackend::query(event); }

 private:
  bool blind_;
};

// Decided on the device (no clipping, a fixed scale), four SGD steps; rank
// 1's grads hold an inf at step 2. Inline (the CPU backends): every rank
// throws NonFiniteGradients at step 2 itself, refused_step 2, nothing
// updated; steps 3 and 4 apply. Lagging (the compute stream treated as a
// GPU's, CheckingOptions::compute_inline), rank 0 blind: step 2 returns (the
// device skipped its update), and step 3's exchange carries rank 1's
// reading: every rank throws there, before updating, refused_step 2; after
// forget(), step 4 applies. Lagging with both ranks blind and step 3
// clipped (the host reads the norm, waiting for the device): step 3 reads
// every verdict left first and throws the same, rather than apply an update
// after a refused one. The params against the steps that applied, and
// settle() at the end reads every verdict left, finding none refused.
enum class Verdicts { kInline, kOneBlind, kBlindThenClipped };

void test_refused_on_the_device(Verdicts verdicts) {
  const bool lagging = verdicts != Verdicts::kInline;
  std::atomic<int> bad{0}, threw{0};
  auto make = [&](int r) {
    const bool blind = verdicts == Verdicts::kBlindThenClipped || (verdicts == Verdicts::kOneBlind && r == 0);
    return std::make_unique<BlindBackend>(CheckingOptions{uint64_t(11 + r), 0, 300, true, !lagging}, blind);
  };
  test::on_ranks_with_backends<BlindBackend>(
      kWorld, make, [&](int r, BlindBackend& backend, CommQueue& data, CommQueue& control) {
      const Tensor param = Tensor::empty({8}, DType::kFloat32, backend, MemoryKind::kDevice, "param");
      const Tensor grad = Tensor::empty({8}, DType::kFloat32, backend, MemoryKind::kDevice, "grad");
      std::fill(param.data_as<float>(), param.data_as<float>() + 8, 1.0f);
      ZeroStep step(ZeroStep::Parts{&data, &control, {FlatRun{0, param, grad, Tensor(), Tensor(), Tensor()}}, true});
      const int throws_at = lagging ? 3 : 2;
      int64_t step_count = 0;
      double want = 1.0;
      for (int s = 1; s <= 4; ++s) {
        const float g = s == 2 && r == 1 ? std::numeric_limits<float>::infinity() : float(r + 1);
        backend.declare_access(backend.compute_stream(), Access::write(grad), "the test writes the grads");
        std::fill(grad.data_as<float>(), grad.data_as<float>() + 8, g);
        const bool clipped = s == 3 && verdicts == Verdicts::kBlindThenClipped;  // by a bound above the norm
        StepOptions options = sgd(clipped ? std::optional<double>(1e9) : std::nullopt);
        options.step = step_count + 1;
        try {
          if (!step.step(options).applied) ++bad;
          ++step_count;
          if (s != 2) want -= kLr * (r + 1.0) / kWorld;
          if (s == throws_at) ++bad;
        } catch (const NonFiniteGradients&) {
          ++threw;
          if (s != throws_at || step.refused_step() != 2) ++bad;
          step_count = step.refused_step() - 1;
          step.forget();
        }
        backend.declare_access(backend.compute_stream(), Access::read(param), "the test reads the params");
        if (!close(param.data_as<float>()[0], want)) ++bad;
      }
      step.settle();
      if (step_count != 2 + (lagging ? 0 : 1) || !backend.violations().empty()) ++bad;
    });
  CHECK(threw == kWorld);
  CHECK(bad == 0);
}

// Dynamic loss scaling over eight steps (initial 8, window 2, hysteresis 2,
// minimum 2), rank 1's grads overflowing at steps 3, 4, 6, 7 and 8. By the
// rule: two clean steps double the scale (8, 8 -> 16); the first overflow
// spends the hysteresis, the second halves (16 -> 8); a clean step (8),
// then each overflow halves (4, then 2, the minimum); the overflow at the
// minimum throws. A clean step updates with grad scale 1/(world * the scale
// before it); a skipped one changes nothing.
void test_dynamic_scale_over_steps() {
  const std::vector<bool> overflow = {false, false, true, true, false, true, true, true};
  const std::vector<double> scale_before = {8, 8, 16, 16, 8, 8, 4, 2};
  std::atomic<int> bad{0};
  test::on_ranks_with_rounds(kWorld, [&](int r, CommQueue& data, CommQueue& control) {
    const Tensor param = filled(std::vector<float>(8, 1.0f));
    const Tensor grad = filled(std::vector<float>(8, 0.0f));
    LossScaler scaler(DynamicScale{8.0, 2, 2, 2.0, false, false});
    ZeroStep::Parts parts{&data, &control, {FlatRun{0, param, grad, Tensor(), Tensor(), Tensor()}}, true};
    parts.loss_scaler = &scaler;
    ZeroStep step(std::move(parts));
    double want = 1.0;  // the param, by the rule
    for (size_t s = 0; s < overflow.size(); ++s) {
      if (scaler.scale() != scale_before[s]) ++bad;
      // The loss-scaled grads this rank holds: (r + 1) * scale, inf on an overflow.
      const float g = overflow[s] && r == 1 ? std::numeric_limits<float>::infinity() : float((r + 1) * scaler.scale());
      std::fill(grad.data_as<float>(), grad.data_as<float>() + 8, g);
      bool threw = false;
      try {
        const StepResult result = step.step(sgd());
        if (result.applied == overflow[s]) ++bad;
      } catch (const NonFiniteGradients&) {
        threw = true;
      }
      if (threw != (s + 1 == overflow.size())) ++bad;
      if (!overflow[s]) want -= kLr * (r + 1.0) / kWorld;  // the unscaled grad (r + 1), averaged over ranks
      if (!close(param.data_as<float>()[0], want)) ++bad;
    }
  });
  CHECK(bad == 0);
}

// Stage 2's reduction with late grads, folded into the step's exchange: two
// backwards accumulate; in the first, rank 1 sends a second grad of param 0
// after its bucket was reduced (it rides along with the second backward's
// reduction of that bucket); in the second, rank 0 sends one of param 2 (it
// stays late until the step's exchange, where every rank reduces that
// bucket again). The step updates by the sum over ranks and backwards of
// every grad sent, computed directly, and the exchange's sum of squares is
// that sum's.
void test_late_grads_in_the_exchange() {
  const LayoutPlan plan = plan_of();
  const int64_t part = plan.partition_elems();
  auto grad_value = [](int r, int param, int64_t i) {
    return float(r + 1) * 0.5f + float(param) - 0.25f * float(i % 5);
  };
  // Per param element: the sum over ranks and backwards of what was sent.
  std::vector<std::vector<double>> summed(kNumels.size());
  for (size_t p = 0; p < kNumels.size(); ++p) {
    summed[p].assign(size_t(kNumels[p]), 0.0);
    for (int64_t i = 0; i < kNumels[p]; ++i) {
      for (int r = 0; r < kWorld; ++r) summed[p][size_t(i)] += 2.0 * grad_value(r, int(p), i);
      if (p == 0) summed[p][size_t(i)] += grad_value(1, 0, i);
      if (p == 2) summed[p][size_t(i)] += grad_value(0, 2, i);
    }
  }
  double sum_sq = 0.0;
  for (const auto& v : summed)
    for (double x : v) sum_sq += x * x;
  std::atomic<int> bad{0};
  test::on_ranks_with_rounds(kWorld, [&](int r, CommQueue& data, CommQueue& control) {
    const Tensor grad_part = filled(std::vector<float>(size_t(part), 0.0f));
    std::vector<float> init(static_cast<size_t>(plan.total_elems()));
    for (size_t i = 0; i < init.size(); ++i) init[i] = param_value(int64_t(i));
    const Tensor full = filled(init);
    BucketReducer reducer(data, {FlatGroupBuffer{0, plan, grad_part}}, DType::kFloat32, 2);
    const std::vector<FlatRun> runs = partition_runs(plan, r, full, grad_part);
    BucketCollectives gather(data, CollectiveKind::kAllGather, {FlatGroupBuffer{0, plan, full}});
    ZeroStep::Parts parts{&data, &control, runs, true, nullptr, &gather};
    parts.grad_reducer = &reducer;
    ZeroStep step(std::move(parts));
    auto send = [&](int param) {
      std::vector<float> g(size_t(kNumels[size_t(param)]));
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad_value(r, param, int64_t(i));
      reducer.grad_ready(0, param, filled(g));
    };
    for (int backward = 0; backward < 2; ++backward) {
      for (int p = int(kNumels.size()) - 1; p >= 0; --p) send(p);
      if (backward == 0 && r == 1) send(0);
      if (backward == 1 && r == 0) send(2);
      reducer.end_backward();
    }
    const Exchanged agreed = step.exchange();
    if (!close(agreed.sum_of_squares, sum_sq)) ++bad;
    const StepResult result = step.step(sgd());
    if (!result.applied) ++bad;
    for (size_t p = 0; p < kNumels.size(); ++p) {
      const Tensor v = full.slice(plan.params()[p].offset, kNumels[p]);
      for (int64_t i = 0; i < kNumels[p]; ++i) {
        const double want = param_value(plan.params()[p].offset + i) - kLr * summed[p][size_t(i)] / kWorld;
        if (!close(v.data_as<float>()[i], want)) ++bad;
      }
    }
  });
  CHECK(bad == 0);
}

// Rank 0 issued a collective of another bucket than rank 1 before the
// step: both throw CollectiveOrderDiverged carrying their own trace, and
// nothing is updated; the next step (the same collectives) goes through.
void test_order_mismatch_throws_on_every_rank() {
  std::atomic<int> threw{0}, bad{0};
  test::on_ranks_with_rounds(kWorld, [&](int r, CommQueue& data, CommQueue& control) {
    const Tensor param = filled(std::vector<float>(8, 1.0f));
    const Tensor grad = filled(std::vector<float>(8, 1.0f));
    ZeroStep step(ZeroStep::Parts{&data, &control, {FlatRun{0, param, grad, Tensor(), Tensor(), Tensor()}}, true});
    const Tensor x = filled(std::vector<float>(4, 1.0f));
    try {
      data.backend().host_wait(*data.all_reduce(CollectiveKey{CollectiveKind::kAllReduce, 7, r, 4}, x));
    } catch (const CollectiveMismatch&) {
    }
    try {
      step.step(sgd());
    } catch (const CollectiveOrderDiverged& e) {
      ++threw;
      if (e.trace.size() != 1 || e.trace[0].bucket != r) ++bad;
    }
    if (param.data_as<float>()[0] != 1.0f) ++bad;
  });
  CHECK(threw == kWorld);
  CHECK(bad == 0);
}

// The step's kernels are its backend's, on the compute stream: a checking
// backend (delays on its other streams, raising at any unordered access)
// counts them. Stages 1-2 on 2 ranks, SGD steps, clipped (a sum of squares
// the host reads) and not (a non-finite count decided on the device) in
// turn: each step one of those and one update, all on the compute stream,
// ordered against the reduction's, the verdict's and the gather's
// collectives; the norm read and every param against the double reference.
class KernelCountingBackend : public CheckingCpuBackend {
 public:
  using CheckingCpuBackend::CheckingCpuBackend;
  void sum_of_squares(Stream& stream, const std::vector<Tensor>& xs, Mailbox& box, int sum_slot,
                      int finite_slot) override {
    ++(&stream == &compute_stream() ? sums : elsewhere);
    CheckingCpuBackend::sum_of_squares(stream, xs, box, sum_slot, finite_slot);
  }
  void count_nonfinite(Stream& stream, const std::vector<Tensor>& xs, const Tensor& counter) override {
    ++(&stream == &compute_stream() ? counts : elsewhere);
    CheckingCpuBackend::count_nonfinite(stream, xs, counter);
  }
  void sgd_update_runs(Stream& stream, const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                       const std::vector<FlatRun>& runs, const Tensor& skip_if) override {
    ++(&stream == &compute_stream() ? updates : elsewhere);
    CheckingCpuBackend::sgd_update_runs(stream, groups, step, grad_scale, runs, skip_if);
  }
  int sums = 0, counts = 0, updates = 0, elsewhere = 0;
};

void test_kernels_run_on_the_backend() {
  const LayoutPlan plan = plan_of();
  const int64_t total = plan.total_elems(), part = plan.partition_elems();
  constexpr int kSteps = 4;
  std::atomic<int> bad{0};
  auto make = [](int r) { return std::make_unique<KernelCountingBackend>(CheckingOptions{uint64_t(3 + r), 0, 300, true}); };
  test::on_ranks_with_backends<KernelCountingBackend>(
      kWorld, make, [&](int r, KernelCountingBackend& backend, CommQueue& data, CommQueue& control) {
      std::vector<float> init(static_cast<size_t>(total));
      for (int64_t i = 0; i < total; ++i) init[size_t(i)] = param_value(i);
      const Tensor full = Tensor::empty({total}, DType::kFloat32, backend, MemoryKind::kDevice, "full");
      const Tensor grad = Tensor::empty({part}, DType::kFloat32, backend, MemoryKind::kDevice, "grad");
      std::memcpy(full.data(), init.data(), full.nbytes());
      const std::vector<FlatRun> runs = partition_runs(plan, r, full, grad);
      BucketCollectives gather(data, CollectiveKind::kAllGather, {FlatGroupBuffer{0, plan, full}});
      ZeroStep step(ZeroStep::Parts{&data, &control, runs, true, nullptr, &gather});
      std::vector<double> want(init.begin(), init.end());
      for (int s = 0; s < kSteps; ++s) {
        // Every rank's partition of this step's summed grads, in the flat
        // layout (bucket b's shard for rank q at offset + q * shard).
        std::vector<double> summed(static_cast<size_t>(total), 0.0);
        double sum_sq = 0.0;
        for (size_t b = 0; b < plan.buckets().size(); ++b) {
          const int64_t shard = plan.shard_elems(int(b));
          for (int q = 0; q < kWorld; ++q) {
            const std::vector<float> g = grads_of(10 * s + q, part);
            for (int64_t k = 0; k < shard; ++k) {
              const double x = g[size_t(plan.partition_offset(int(b)) + k)];
              summed[size_t(plan.buckets()[b].offset + q * shard + k)] = x;
              sum_sq += x * x;
            }
          }
        }
        const std::vector<float> mine = grads_of(10 * s + r, part);
        backend.declare_access(backend.compute_stream(), Access::write(grad), "the test writes the grads");
        std::memcpy(grad.data(), mine.data(), grad.nbytes());
        const bool clipped = s % 2 == 1;  // by a bound above the norm: the grads unchanged
        StepOptions options = sgd(clipped ? std::optional<double>(1e9) : std::nullopt);
        options.step = s + 1;
        const StepResult result = step.step(options);
        const double scale = 1.0 / kWorld;
        if (!result.applied || (clipped && !close(result.norm, std::sqrt(sum_sq) * scale))) ++bad;
        for (int64_t i = 0; i < total; ++i) want[size_t(i)] -= kLr * scale * summed[size_t(i)];
        // The gather's output is read once the compute stream waited for it.
        backend.declare_access(backend.compute_stream(), Access::read(full), "the test reads the params");
        for (int64_t i = 0; i < total; ++i) {
          if (!close(full.data_as<float>()[i], want[size_t(i)])) ++bad;
        }
      }
      if (backend.sums != kSteps / 2 || backend.counts != kSteps / 2 || backend.updates != kSteps ||
          backend.elsewhere != 0) {
        ++bad;
      }
      if (!backend.violations().empty()) ++bad;
    });
  CHECK(bad == 0);
}

// Offload: each rank's partition (an fp32 master and its host grads) lives
// on the host of a checking backend; its grads come down from "device"
// buffers and its params go up to them. Four steps, delayed from step 2:
// step 1 overlapped (the new params up at once), step 2 delayed (the device
// keeps step 1's params, the update pending), step 3 a non-finite grad on
// rank 1 (skipped on every rank; the pending update's params go up, the
// scale halves), step 4 delayed again (pending until params_up). After each,
// the device params against the SGD steps computed directly, the norm
// against the ranks' grads, and no ordering violation. With a fixed scale
// the step decides on the device (the verdict on the host update's
// stream): step 3 throws NonFiniteGradients on every rank at once (the
// CPU backends), with the pending update landed and step 3's not applied.
void test_host_update(bool dynamic) {
  constexpr int64_t n = 300;
  const std::vector<bool> overflow = {false, false, true, false};
  std::atomic<int> bad{0}, threw{0};
  auto make = [](int r) { return std::make_unique<CheckingCpuBackend>(CheckingOptions{uint64_t(7 + r), 0, 300, true}); };
  test::on_ranks_with_backends<CheckingCpuBackend>(
      kWorld, make, [&](int r, CheckingCpuBackend& backend, CommQueue& data, CommQueue& control) {
    auto buffer = [&](MemoryKind kind, const char* name, const std::vector<float>& values) {
      Tensor t = backend.allocate(kind, size_t(n) * sizeof(float), name)->view(0, DType::kFloat32, {n});
      std::memcpy(t.data(), values.data(), t.nbytes());
      return t;
    };
    std::vector<float> init(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) init[size_t(i)] = param_value(i + r * n);
    const Tensor device_grads = buffer(MemoryKind::kDevice, "device_grads", std::vector<float>(size_t(n), 0.0f));
    const Tensor device_params = buffer(MemoryKind::kDevice, "device_params", init);
    const Tensor master = buffer(MemoryKind::kHostPinned, "master", init);
    const Tensor host_grads = buffer(MemoryKind::kHostPinned, "host_grads", std::vector<float>(size_t(n), 0.0f));
    OffloadOptimizer optimizer({OffloadBucket{{FlatRun{0, master, host_grads, Tensor(), Tensor(), Tensor()}},
                                              {TensorCopy{device_grads, host_grads}},
                                              {TensorCopy{master, device_params}},
                                              {}}},
                               backend);
    HostUpdate host(optimizer, /*swaps_grads=*/false, /*delays_from=*/2);
    LossScaler scaler(DynamicScale{4.0, 2000, 1, 1.0, false, false});
    ZeroStep::Parts parts{&data, &control, {}, true};
    parts.loss_scaler = dynamic ? &scaler : nullptr;
    parts.host_update = &host;
    ZeroStep step(std::move(parts));
    std::vector<double> want(init.begin(), init.end()), on_device = want;  // the master, the device's params
    int64_t applied = 0;
    for (size_t s = 0; s < overflow.size(); ++s) {
      const double scale = 1.0 / (kWorld * step.loss_scale());
      double sum_sq = 0.0;
      for (int q = 0; q < kWorld; ++q) {
        for (float g : grads_of(10 * int(s) + q, n)) sum_sq += double(g) * g;
      }
      std::vector<float> g = grads_of(10 * int(s) + r, n);
      if (overflow[s] && r == 1) g[5] = std::numeric_limits<float>::infinity();
      std::memcpy(device_grads.data(), g.data(), device_grads.nbytes());
      StepOptions options = sgd();
      options.step = applied + 1;
      StepResult result;
      try {
        result = step.step(options);
        if (result.applied == overflow[s]) ++bad;
      } catch (const NonFiniteGradients&) {
        ++threw;
        if (dynamic || !overflow[s] || step.refused_step() != options.step) ++bad;
        step.forget();
      }
      if (overflow[s]) {
        on_device = want;  // the pending update landed
        // Decided on the device, step 3's update was queued and skipped: its params (unchanged) are pending.
        if (host.pending() == dynamic) ++bad;
      } else {
        if (dynamic && !close(result.norm, std::sqrt(sum_sq) * scale)) ++bad;
        ++applied;
        for (int64_t i = 0; i < n; ++i) want[size_t(i)] -= kLr * scale * g[size_t(i)];
        const bool delayed = options.step >= 2;
        if (host.pending() != delayed) ++bad;
        if (!delayed) on_device = want;
      }
      for (int64_t i = 0; i < n; ++i) {
        if (!close(device_params.data_as<float>()[i], on_device[size_t(i)])) ++bad;
      }
    }
    if (!host.params_up() || host.pending()) ++bad;  // step 4's update lands
    for (int64_t i = 0; i < n; ++i) {
      if (!close(device_params.data_as<float>()[i], want[size_t(i)])) ++bad;
    }
    if (scaler.scale() != (dynamic ? 2.0 : 4.0) || !backend.violations().empty()) ++bad;
  });
  CHECK(bad == 0);
  CHECK(threw == (dynamic ? 0 : kWorld));
}

}  // namespace
}  // namespace zerocore

int main() {
  using zerocore::Stage;
  for (Stage stage : {Stage::kZero, Stage::kOneTwo, Stage::kThree}) {
    zerocore::test_step(stage, 4.0, std::nullopt);
    zerocore::test_step(stage, 1.0, 0.3);  // clipped to 0.3 of the norm
    zerocore::test_step(stage, 1.0, 3.0);  // a bound above the norm: no clipping
  }
  zerocore::test_exchange_then_step();
  zerocore::test_overflow_on_every_rank(/*dynamic=*/true);
  zerocore::test_overflow_on_every_rank(/*dynamic=*/false);
  for (auto verdicts : {zerocore::Verdicts::kInline, zerocore::Verdicts::kOneBlind,
                        zerocore::Verdicts::kBlindThenClipped}) {
    zerocore::test_refused_on_the_device(verdicts);
  }
  zerocore::test_dynamic_scale_over_steps();
  zerocore::test_late_grads_in_the_exchange();
  zerocore::test_order_mismatch_throws_on_every_rank();
  zerocore::test_kernels_run_on_the_backend();
  zerocore::test_host_update(/*dynamic=*/true);
  zerocore::test_host_update(/*dynamic=*/false);
  return zerocore::test::finish("test_step");
}
