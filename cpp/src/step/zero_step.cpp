#include "zerocore/step/zero_step.h"

#include <algorithm>
#include <cmath>

#include "zerocore/error.h"
#include "zerocore/kernels/cpu_reduce.h"

namespace zerocore {

namespace {

// A row of the exchange: this rank's sum of squares, its trainability
// changes and its data queue's fingerprint, as float64. The fingerprint
// keeps 52 bits, exact in a double (Python's Communicator does the same).
constexpr int64_t kRow = 3;
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
  for (const FlatRun& run : parts_.runs) grads_.push_back(run.grad);
  rows_.resize(size_t(parts_.control->world_size() * kRow));
}

const Exchanged& ZeroStep::exchange(int64_t changes, std::optional<double> local) {
  if (exchanged_) return *exchanged_;
  if (parts_.grad_reduce != nullptr) parts_.grad_reduce->run();
  const double mine = local ? *local : sum_of_squares(grads_);
  std::vector<double> row = {mine, double(changes), double(parts_.data->fingerprint() >> 12)};
  const Tensor gathered = as_halves(rows_);
  const auto done = parts_.control->all_gather(
      CollectiveKey{CollectiveKind::kAllGather, -1, kNormsPurpose, gathered.numel()}, as_halves(row), gathered);
  parts_.control->backend().host_wait(*done);  // the step's one blocking wait: the host decides on the sums
  const double* rows = rows_.data();
  const int world = parts_.control->world_size();
  Exchanged out;
  bool diverged = false;
  for (int r = 0; r < world; ++r) {  // in rank order, so every rank gets the same bits
    out.sum_of_squares += rows[r * kRow];
    out.changes += int64_t(rows[r * kRow + 1]);
    diverged |= rows[r * kRow + 2] != rows[2];
  }
  std::vector<CollectiveKey> trace = diverged ? parts_.data->trace() : std::vector<CollectiveKey>{};
  parts_.data->restart_trace();
  if (diverged) {
    throw CollectiveOrderDiverged(
        "zerocore: ranks issued different collectives since the last step (their order fingerprints differ). "
        "Nothing was updated. Every rank must issue the same collectives in the same order.",
        std::move(trace));
  }
  if (!parts_.partitioned) out.sum_of_squares = mine;  // every rank holds all the grads
  exchanged_ = out;
  return *exchanged_;
}

StepResult ZeroStep::step(const StepOptions& options) {
  const Exchanged agreed = exchange();
  StepResult out;
  double grad_scale = 1.0 / (parts_.data->world_size() * options.loss_scale);
  out.norm = std::sqrt(agreed.sum_of_squares) * grad_scale;
  if (!std::isfinite(agreed.sum_of_squares)) return out;
  if (options.max_norm) grad_scale *= std::min(1.0, *options.max_norm / (out.norm + 1e-6));
  if (options.kind == OptimizerKind::kSgd) {
    sgd_update_runs(options.sgd, options.step, grad_scale, parts_.runs);
  } else {
    adam_update_runs(options.adam, options.step, grad_scale, parts_.runs);
  }
  if (parts_.param_gather != nullptr) parts_.param_gather->run();
  exchanged_.reset();
  out.applied = true;
  out.grad_scale = grad_scale;
  return out;
}

}  // namespace zerocore
