#include "zerocore/step/zero_step.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "zerocore/error.h"
#include "zerocore/kernels/cpu_reduce.h"
#include "zerocore/step/host_update.h"

namespace zerocore {

namespace {

// A row of the exchange: this rank's sum of squares, its trainability
// changes, its data queue's fingerprint and its late buckets, as float64.
// The fingerprint keeps 52 bits, exact in a double; the late buckets are
// bit flags, kLateBits to a double (exact integers: the row crosses as raw
// bytes, but every value in it stays a plain finite number).
constexpr size_t kHead = 3;
constexpr size_t kLateBits = 52;
// The exchange's key: a control all-gather whose bucket says what it is
// for (python/zerocore/comm.py names bucket 1 "the step's norm exchange").
constexpr int32_t kNormsPurpose = 1;
// The control queue moves float tensors: float64 rows cross as fp16
// halves. Host memory of the step's own, outside the arenas, whose bytes
// memory_report() accounts for model states and communication buffers.
Tensor as_halves(std::vector<double>& values) {
  return Tensor(values.data(), DType::kFloat16, Device{}, {int64_t(values.size() * sizeof(double) / 2)}, nullptr);
}

}  // namespace

ZeroStep::ZeroStep(Parts parts) : parts_(std::move(parts)) {
  if (parts_.data == nullptr || parts_.control == nullptr) {
    throw InvalidArgument("ZeroStep: give the data queue (its order is checked) and the control queue (the exchange)");
  }
  if (parts_.data->world_size() != parts_.control->world_size()) {
    throw InvalidArgument("ZeroStep: the data and control queues span different world sizes (" +
                          std::to_string(parts_.data->world_size()) + " and " +
                          std::to_string(parts_.control->world_size()) + "); make both over the same ranks");
  }
  if (!parts_.runs.empty() && parts_.host_update != nullptr) {
    throw InvalidArgument("ZeroStep: give the runs (the step updates them in place) or the host update "
                          "(offload), not both");
  }
  // The sum of squares and the update below are the CPU kernels, not yet
  // the backend's (docs/design.md, Status): a partition on a device is
  // refused here, at wrap, rather than read from the host in the first step.
  for (size_t i = 0; i < parts_.runs.size(); ++i) {
    const FlatRun& run = parts_.runs[i];
    for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"param", run.param}, {"grad", run.grad}}) {
      if (t.device().type != DeviceType::kCPU) {
        throw InvalidArgument("ZeroStep: run " + std::to_string(i) + "'s " + name + " is on cuda:" +
                              std::to_string(t.device().index) +
                              ", but the step's sum of squares and in-place update still run the CPU kernels, not "
                              "its backend's (docs/design.md, Status): the engine cannot step a partition on a GPU "
                              "yet; train on the CPU (model.cpu())");
      }
    }
    grads_.push_back(run.grad);
  }
}

Exchanged ZeroStep::exchange_rows(double mine, int64_t changes, std::vector<bool>& late) {
  const size_t words = (late.size() + kLateBits - 1) / kLateBits;
  const size_t width = kHead + words;
  std::vector<double> row(width, 0.0);
  row[0] = mine;
  row[1] = double(changes);
  row[2] = double(parts_.data->fingerprint() >> 12);
  for (size_t i = 0; i < late.size(); ++i) {
    if (late[i]) row[kHead + i / kLateBits] += double(uint64_t(1) << (i % kLateBits));
  }
  const int world = parts_.control->world_size();
  rows_.resize(size_t(world) * width);
  const Tensor gathered = as_halves(rows_);
  const auto done = parts_.control->all_gather(
      CollectiveKey{CollectiveKind::kAllGather, -1, kNormsPurpose, gathered.numel()}, as_halves(row), gathered);
  parts_.control->backend().host_wait(*done);  // the step's one blocking wait: the host decides on the sums
  Exchanged out;
  bool diverged = false;
  std::vector<uint64_t> any(words, 0);
  for (int r = 0; r < world; ++r) {  // in rank order, so every rank gets the same bits
    const double* theirs = rows_.data() + size_t(r) * width;
    out.sum_of_squares += theirs[0];
    out.changes += int64_t(theirs[1]);
    diverged |= theirs[2] != row[2];
    for (size_t w = 0; w < words; ++w) any[w] |= uint64_t(theirs[kHead + w]);
  }
  std::vector<CollectiveKey> trace = diverged ? parts_.data->trace() : std::vector<CollectiveKey>{};
  parts_.data->restart_trace();
  if (diverged) {
    throw CollectiveOrderDiverged(
        "zerocore: ranks issued different collectives since the last step (their order fingerprints differ). "
        "Nothing was updated. Every rank must issue the same collectives in the same order.",
        std::move(trace));
  }
  for (size_t i = 0; i < late.size(); ++i) late[i] = (any[i / kLateBits] >> (i % kLateBits)) & 1u;
  if (!parts_.partitioned) out.sum_of_squares = mine;  // every rank holds all the grads
  return out;
}

const Exchanged& ZeroStep::exchange(int64_t changes) {
  if (exchanged_) return *exchanged_;
  if (parts_.grad_reduce != nullptr) parts_.grad_reduce->run();
  double mine = parts_.host_update ? parts_.host_update->grad_sum_of_squares() : sum_of_squares(grads_);
  BucketReducer* reducer = parts_.grad_reducer;
  std::vector<bool> late = reducer ? reducer->late() : std::vector<bool>{};
  Exchanged agreed = exchange_rows(mine, changes, late);
  if (std::find(late.begin(), late.end(), true) != late.end()) {
    // Grads came after their bucket was reduced (reentrant checkpointing),
    // on some rank: every rank reduces those buckets, so all issue the same
    // collectives, and the sums are exchanged again, since they changed.
    // The reducer's partitions are the grads this rank's sum is over.
    reducer->reduce_late(late);
    mine = reducer->grad_sum_of_squares();
    late.assign(late.size(), false);
    agreed = exchange_rows(mine, changes, late);
  }
  exchanged_ = agreed;
  return *exchanged_;
}

StepResult ZeroStep::step(const StepOptions& options) {
  const Exchanged agreed = exchange(options.changes);
  if (agreed.changes != 0) {
    throw TrainabilityChanged("zerocore: " + std::to_string(agreed.changes) +
                              " trainability change(s) since the layout was planned; nothing was updated");
  }
  StepResult out;
  LossScaler* scaler = parts_.loss_scaler;
  double grad_scale = 1.0 / (parts_.data->world_size() * loss_scale());
  out.norm = std::sqrt(agreed.sum_of_squares) * grad_scale;
  out.applied = std::isfinite(agreed.sum_of_squares);
  if (!out.applied) {
    if (scaler == nullptr || !scaler->dynamic()) {
      throw NonFiniteGradients(
          "zerocore: gradients hold inf/NaN at step " + std::to_string(options.step) +
          " (a NaN or inf loss?); the step was not applied and params and optimizer state are unchanged. Train "
          "in fp16 with dynamic loss scaling (dtype='fp16') to skip such steps instead.");
    }
    scaler->update(true);  // backs off; throws at the minimum scale
    // The next forward reads a pending update's params (and, in stages 1-2,
    // every rank's); stage 3's end-of-step round below releases any unit
    // gathered from the shards they replace.
    if (parts_.host_update != nullptr && parts_.host_update->params_up() && parts_.param_gather != nullptr) {
      parts_.param_gather->run();
    }
  } else {
    if (options.max_norm) grad_scale *= std::min(1.0, *options.max_norm / (out.norm + 1e-6));
    if (options.kind == OptimizerKind::kSgd) {
      sgd_update_runs(options.sgd, options.step, grad_scale, parts_.runs);
    } else {
      adam_update_runs(options.adam, options.step, grad_scale, parts_.runs);
    }
    if (parts_.host_update != nullptr) parts_.host_update->apply(options, grad_scale);
    if (parts_.param_gather != nullptr) parts_.param_gather->run();
    if (scaler != nullptr) scaler->update(false);
    out.grad_scale = grad_scale;
  }
  exchanged_.reset();
  if (parts_.units != nullptr) parts_.units->end_step();  // gathers the next forward's first units, updated
  return out;
}

}  // namespace zerocore
