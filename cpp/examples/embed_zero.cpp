// A C++ trainer that embeds zerocore with no Python and no torch: a two-layer
// MLP trained with ZeRO stage 2 and stage 3 on ranks that are threads of this
// process, over the in-process communicator, checked against the same MLP
// and AdamW written out in double on the whole batch (mlp_reference.h:
// plain scalar code, no zerocore). Exits non-zero if they disagree.
//
// Each layer is one unit and one flat group: its partition store keeps its
// buffers and hands out every view into them (the trainer computes no
// offset), the step's runs (flat_runs) and the buffers the runtime's
// collectives take (group_buffer). The trainer computes and says what
// happens; the runtime does the distributed work, as for the Python engine,
// through one EngineCore (engine/engine_core.h) built from the stores, the
// units and the stage: stage 3's UnitSchedule gathers and releases units at
// the hooks (pre_forward, post_forward, pre_backward, post_backward); the
// BucketReducer reduce-scatters each param's grad (grad_ready) into the grad
// partition, in stage 3 when the schedule says every rank has the unit's
// grads; one step call a step does the rest (the exchange, the dynamic
// loss scale, the update, stage 2's param gather, stage 3's end-of-step round).
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlp_reference.h"
#include "zerocore/zerocore.h"

using namespace zerocore;

namespace {

constexpr int64_t kAlign = 16, kBucketElems = 64;
// fp32 training against double: measured up to 1.1e-7 in the params and 2.4e-7 in the losses, while
// 6 steps at lr 1e-2 move the params by up to 6e-2.
constexpr double kParamTolerance = 2e-6, kLossTolerance = 2e-6;

// One layer y = x W^T + b: a unit of params W (out x in) and b (out), and one flat group.
constexpr int kBias = 0, kWeight = 1;  // in the layout: backward order
struct Layer {
  int in, out;
  int32_t tag;  // its flat group's: its place in the reduction order, the last layer first (its grads come first)
  PartitionStore store;
  Tensor params;  // stage 2: the full flat params; stage 3: this rank's shard
  Tensor grads;   // full flat grads of this rank's micro-batch
};

class ZeroMlp {
 public:
  // rounds: stage 3's queue for the unit schedule's rounds, over a process group of its own.
  ZeroMlp(int stage, CommQueue& comm, CommQueue& rounds, const std::vector<float>& init)
      : rank_(comm.rank()), world_(comm.world_size()) {
    const float* values = init.data();  // [W..., b...] layer by layer
    for (auto [in, out, tag] : {std::array{kIn, kHidden, 1}, std::array{kHidden, kOut, 0}}) {
      StorePlacement place;
      place.rank = rank_;
      place.sharded = stage == 3;
      place.partitions_grads = true;
      place.state_names = {"exp_avg", "exp_avg_sq"};
      const LayoutPlan plan = LayoutPlan::make({{out, 0}, {int64_t(in) * out, 0}}, {world_, kAlign, kBucketElems});
      Layer& l = layers_.emplace_back(Layer{in, out, tag, PartitionStore(plan, place, comm.backend()), {}, {}});
      l.store.allocate();
      l.params = l.store.buffer(place.sharded ? "shard" : "full");
      l.grads = Tensor::empty({plan.total_elems()}, DType::kFloat32);
      values = fill(l, values);
    }
    // The runtime's core, built from the stores (in reduction order: their
    // tags), the units (stage 3: one a layer) and the stage: the reducer,
    // stage 3's schedule (whose rounds reduce each unit's grads), stage 2's
    // param gather and the step, connected. The step's exchange shares the
    // rounds' queue: every rank issues on it in the same order.
    EngineCore::Description d;
    d.queues = {&comm, &rounds, nullptr, &rounds};
    d.groups.resize(layers_.size());
    for (Layer& l : layers_) d.groups[size_t(l.tag)] = {&l.store, l.tag, {}};
    if (stage == 3) d.units = {{{layers_[0].tag}, false}, {{layers_[1].tag}, false}};
    d.stage = stage;
    d.loss_scaler = &scaler_;
    core_ = std::make_unique<EngineCore>(d);
  }

  // One optimizer step on this rank's rows of the global batch; returns the
  // rank's mean squared error.
  float step(int step_index) {
    const int rows = kBatch / world_, first = rank_ * rows;
    std::vector<float> x(size_t(rows) * kIn), y(size_t(rows) * kOut);
    for (int s = 0; s < rows; ++s) {
      for (int i = 0; i < kIn; ++i) x[size_t(s * kIn + i)] = input(first + s, i);
      for (int o = 0; o < kOut; ++o) y[size_t(s * kOut + o)] = target(first + s, o);
    }
    // Forward.
    std::vector<float> h = forward(0, x, rows);
    for (float& v : h) v = std::max(v, 0.0f);
    std::vector<float> out = forward(1, h, rows);
    float loss = 0.0f;
    std::vector<float> d_out(out.size());
    for (size_t i = 0; i < out.size(); ++i) {
      const float e = out[i] - y[i];
      loss += e * e;
      d_out[i] = float(scaler_.scale()) * 2.0f * e / float(out.size());  // d(scaled mean squared error)
    }
    if (schedule()) schedule()->end_forward();
    // Backward, last unit first; each unit's buckets reduce while the next computes.
    if (schedule()) schedule()->begin_backward();
    std::vector<float> d_h = backward(1, h, d_out, rows);
    for (size_t i = 0; i < d_h.size(); ++i) d_h[i] = h[i] > 0.0f ? d_h[i] : 0.0f;
    backward(0, x, d_h, rows);
    if (schedule()) schedule()->end_backward();  // first: its last round hands the units' grads to the reducer
    core_->reducer()->end_backward();
    // The grads hold the sum over ranks of per-rank means: the step averages them.
    StepOptions options;
    options.adam = {AdamOptions{kLr, kBeta1, kBeta2, kEps, kWeightDecay, /*adamw=*/true}};
    options.step = step_index;
    if (!core_->step(options).applied) throw std::runtime_error("embed_zero: the grads overflowed");
    for (Layer& l : layers_) l.store.zero_grads();  // zero_grad: the reducer adds into the grad partition
    return loss / float(out.size());
  }

  // Every param, in the order of `init` (W then b, layer by layer).
  std::vector<float> full_params() {
    std::vector<float> out;
    for (int unit = 0; unit < int(layers_.size()); ++unit) {
      const Layer& l = layers_[size_t(unit)];
      Tensor gathered = l.params;
      if (schedule()) {
        gathered = Tensor::empty({l.store.plan().total_elems()}, DType::kFloat32);
        schedule()->gather_into(unit, gathered);
      }
      for (int param : {kWeight, kBias}) {
        const Tensor v = l.store.param_view(gathered, param);
        out.insert(out.end(), v.data_as<float>(), v.data_as<float>() + v.numel());
      }
    }
    return out;
  }

 private:
  // Initial values [W..., b...] into this rank's params (stage 3: its pieces
  // of them); returns where the next layer's begin.
  static const float* fill(Layer& l, const float* values) {
    for (int param : {kWeight, kBias}) {
      for (const auto& [first, view] : l.store.param_stretches(l.params, param)) {
        std::memcpy(view.data(), values + first, view.nbytes());
      }
      values += l.store.plan().params()[size_t(param)].numel;
    }
    return values;
  }

  std::vector<float> forward(int unit, const std::vector<float>& x, int rows) {
    const Layer& l = layers_[size_t(unit)];
    const Tensor flat = schedule() ? schedule()->pre_forward(unit, /*marks_post_backward=*/true).buffer : l.params;
    const float* w = l.store.param_view(flat, kWeight).data_as<float>();
    const float* b = l.store.param_view(flat, kBias).data_as<float>();
    std::vector<float> y(size_t(rows) * l.out);
    for (int s = 0; s < rows; ++s) {
      for (int o = 0; o < l.out; ++o) {
        float acc = b[o];
        for (int i = 0; i < l.in; ++i) acc += x[size_t(s * l.in + i)] * w[o * l.in + i];
        y[size_t(s * l.out + o)] = acc;
      }
    }
    if (schedule()) schedule()->post_forward(unit, /*backward_follows=*/true);
    return y;
  }

  // Hands the unit's grads to the reducer and returns the input grads.
  std::vector<float> backward(int unit, const std::vector<float>& x, const std::vector<float>& dy, int rows) {
    const Layer& l = layers_[size_t(unit)];
    const Tensor flat = schedule() ? schedule()->pre_backward(unit).buffer : l.params;
    const float* w = l.store.param_view(flat, kWeight).data_as<float>();
    std::memset(l.grads.data(), 0, l.grads.nbytes());
    float* gw = l.store.param_view(l.grads, kWeight).data_as<float>();
    float* gb = l.store.param_view(l.grads, kBias).data_as<float>();
    std::vector<float> dx(size_t(rows) * l.in, 0.0f);
    for (int s = 0; s < rows; ++s) {
      for (int o = 0; o < l.out; ++o) {
        const float d = dy[size_t(s * l.out + o)];
        gb[o] += d;
        for (int i = 0; i < l.in; ++i) {
          gw[o * l.in + i] += d * x[size_t(s * l.in + i)];
          dx[size_t(s * l.in + i)] += d * w[o * l.in + i];
        }
      }
    }
    for (int param : {kBias, kWeight}) core_->reducer()->grad_ready(l.tag, param, l.store.param_view(l.grads, param));
    if (schedule()) schedule()->post_backward(unit);
    return dx;
  }

  UnitSchedule* schedule() { return core_->schedule(); }  // stage 3

  const int rank_, world_;
  std::vector<Layer> layers_;
  // fp16's dynamic scaling, as the engine's: fp32 grads never overflow
  // here, so the scale doubles every `window` steps and the step unscales.
  LossScaler scaler_{DynamicScale{1024.0, /*window=*/2, /*hysteresis=*/1, /*min_scale=*/1.0, false, false}};
  std::unique_ptr<EngineCore> core_;
};

// Trains on `world` threads; returns rank 0's params after kSteps and every
// step's loss averaged over ranks.
std::vector<float> train(int stage, int world, std::vector<float>* losses) {
  const std::vector<float> init = initial_params();
  // ZEROCORE_LATE_COMPLETION=<seed> makes the collectives complete late, as
  // NCCL's do: the training must not change (ctest runs it both ways).
  InProcessGroup data_group(world, late_completion_from_env()), rounds_group(world, late_completion_from_env());
  std::vector<std::vector<float>> params(static_cast<size_t>(world));
  std::vector<std::vector<float>> rank_losses(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      // Every rank's buffers and streams on the process's plain CPU backend.
      Backend& backend = default_cpu_backend();
      CommQueue comm(data_group.transport(r), backend), rounds(rounds_group.transport(r), backend);
      ZeroMlp mlp(stage, comm, rounds, init);
      for (int s = 1; s <= kSteps; ++s) rank_losses[size_t(r)].push_back(mlp.step(s));
      params[size_t(r)] = mlp.full_params();
    });
  }
  for (auto& t : threads) t.join();
  losses->assign(kSteps, 0.0f);
  for (const auto& l : rank_losses) {
    for (int s = 0; s < kSteps; ++s) (*losses)[size_t(s)] += l[size_t(s)] / float(world);
  }
  return params[0];
}

}  // namespace

int main() {
  std::vector<double> ref_losses;
  const std::vector<double> reference = reference_train(&ref_losses);
  std::printf("embed_zero: MLP %d-%d-%d, %zu params, %d steps of AdamW, global batch %d\n", kIn, kHidden, kOut,
              reference.size(), kSteps, kBatch);
  std::printf("  double, 1 process: loss %.6f -> %.6f\n", ref_losses.front(), ref_losses.back());
  int failures = 0;
  for (int stage : {2, 3}) {
    for (int world : {1, 2, 4}) {
      std::vector<float> losses;
      const std::vector<float> got = train(stage, world, &losses);
      double worst = 0.0, worst_loss = 0.0;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(double(got[i]) - reference[i]));
      for (int s = 0; s < kSteps; ++s) {
        worst_loss = std::max(worst_loss, std::fabs(double(losses[size_t(s)]) - ref_losses[size_t(s)]));
      }
      const bool ok = worst <= kParamTolerance && worst_loss <= kLossTolerance;
      failures += !ok;
      std::printf("  stage %d, %d rank(s): loss %.6f -> %.6f, largest difference to double: params %.2e, "
                  "losses %.2e %s\n", stage, world, losses.front(), losses.back(), worst, worst_loss,
                  ok ? "ok" : "MISMATCH");
    }
  }
  return failures ? 1 : 0;
}
