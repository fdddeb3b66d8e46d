#include "zerocore/step/zero_step.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "zerocore/error.h"
#include "zerocore/backend/backend.h"
#include "zerocore/comm/control_key.h"
#include "zerocore/step/host_update.h"

namespace zerocore {

namespace {

// A row of the exchange: this rank's sum of squares (and the kernel's
// finite flag beside it, which the sum already carries), its trainability
// changes, its data queue's fingerprint, whether the row carries the sum
// (ranks must agree), the first step the device refused that this rank
// read of, its late buckets and, at stage 3, the flags of the unit
// schedule's end-of-step round, as float64.
// The fingerprint keeps 52 bits, exact in a double; the late buckets are
// bit flags, kLateBits to a double (exact integers: the row crosses as raw
// bytes, but every value in it stays a plain finite number).
constexpr int kSum = 0;
constexpr int kFinite = 1;
constexpr int kChanges = 2;
constexpr int kFingerprint = 3;
constexpr int kWithSum = 4;
constexpr int kRefused = 5;
constexpr size_t kHead = 6;
constexpr size_t kLateBits = 52;
// The control queue moves float tensors: float64 rows cross as fp16
// halves. The gathered rows are host memory of the step's own, outside the
// arenas, whose bytes memory_report() accounts for model states and
// communication buffers.
Tensor as_halves(double* values, size_t count, std::shared_ptr<void> owner) {
  return Tensor(values, DType::kFloat16, Device{}, {int64_t(count * sizeof(double) / 2)}, std::move(owner));
}

Backend& backend_of(const ZeroStep::Parts& parts) {
  if (parts.data == nullptr || parts.control == nullptr) {
    throw InvalidArgument("ZeroStep: give the data queue (its order is checked) and the control queue (the exchange)");
  }
  return parts.data->backend();
}

// The ranks' sum of their verdict flags, on the data queue (folded into
// the order fingerprint as any data collective; not training traffic).
const CollectiveKey kVerdictKey{CollectiveKind::kAllReduce, kStepVerdictGroup, 0, 1};

const char* const kNonFiniteAdvice =
    "Most often the loss was NaN or inf: check this step's batches (bad data, an empty or all-padding batch, a log "
    "of 0) and the loss; engine.zero_grad() on every rank gives the step up, and training can go on with the next "
    "batch. If 16-bit grads overflowed, fp16 with dynamic loss scaling (dtype='fp16') skips such steps instead.";

}  // namespace

ZeroStep::ZeroStep(Parts parts)
    : parts_(std::move(parts)),
      verdict_(backend_of(parts_), parts_.host_update ? &parts_.host_update->stream() : nullptr) {
  if (parts_.data->world_size() != parts_.control->world_size()) {
    throw InvalidArgument("ZeroStep: the data and control queues span different world sizes (" +
                          std::to_string(parts_.data->world_size()) + " and " +
                          std::to_string(parts_.control->world_size()) + "); make both over the same ranks");
  }
  if (!parts_.runs.empty() && parts_.host_update != nullptr) {
    throw InvalidArgument("ZeroStep: give the runs (the step updates them in place) or the host update "
                          "(offload), not both");
  }
  if (&parts_.data->backend() != &parts_.control->backend()) {
    throw InvalidArgument("ZeroStep: the data and control queues run on different backends; make both on the "
                          "engine's (the exchange reads a row the data queue's backend writes)");
  }
  if (parts_.host_update != nullptr && &parts_.host_update->backend() != &parts_.data->backend()) {
    throw InvalidArgument("ZeroStep: the host update's optimizer runs on another backend than the queues; make its "
                          "OffloadOptimizer on theirs (the step orders its streams with theirs)");
  }
  const CommQueue* reductions = parts_.reductions;
  if (reductions != nullptr && (reductions->world_size() != parts_.data->world_size() ||
                                &reductions->backend() != &parts_.data->backend())) {
    throw InvalidArgument("ZeroStep: the reductions' queue must span the data queue's ranks on its backend");
  }
  for (const FlatRun& run : parts_.runs) grads_.push_back(run.grad);
  size_row();
}

uint64_t ZeroStep::fingerprint_of_queues() const {
  const uint64_t data = parts_.data->fingerprint();
  if (parts_.reductions == nullptr) return data;
  // Which queue issued what matters too: the reductions' rotated in.
  const uint64_t reductions = parts_.reductions->fingerprint();
  return data ^ ((reductions << 17) | (reductions >> 47)) ^ 0x9e3779b97f4a7c15ull;
}

void ZeroStep::set_grad_reducer(BucketReducer* reducer) {
  parts_.grad_reducer = reducer;
  size_row();
}

size_t ZeroStep::late_words() const {
  const size_t late_buckets = parts_.grad_reducer ? parts_.grad_reducer->late().size() : 0;
  return (late_buckets + kLateBits - 1) / kLateBits;
}

void ZeroStep::size_row() {
  const int64_t flags = parts_.units ? parts_.units->step_round_width() : 0;
  const int width = int(kHead + late_words() + size_t(flags));
  if (!row_ || row_->slots() != width) row_ = std::make_unique<Mailbox>(backend(), width, "the step's exchange row");
}

Exchanged ZeroStep::exchange_rows(int64_t changes, std::vector<bool>& late, Stream* summed_on) {
  const bool with_sum = summed_on != nullptr;
  Mailbox& box = *row_;
  const size_t width = size_t(box.slots());
  std::vector<uint64_t> bits(late_words(), 0);
  const size_t flags_at = kHead + bits.size();
  for (size_t i = 0; i < late.size(); ++i) {
    if (late[i]) bits[i / kLateBits] |= uint64_t(1) << (i % kLateBits);
  }
  box.write(kChanges, double(changes));
  const double fingerprint = double(fingerprint_of_queues() >> 12);
  box.write(kFingerprint, fingerprint);
  box.write(kWithSum, with_sum ? 1.0 : 0.0);
  box.write(kRefused, double(verdict_read_));
  for (size_t w = 0; w < bits.size(); ++w) box.write(int(kHead + w), double(bits[w]));
  for (size_t i = 0; i < unit_flags_.size(); ++i) box.write(int(flags_at + i), double(unit_flags_[i]));
  Backend& b = backend();
  // With the sum, the all-gather reads the row once the stream that wrote
  // the sum of squares there is done: on the device, not the host; the
  // host's wait below is then a wait for the device.
  if (with_sum) b.wait(parts_.control->stream(), *b.record(*summed_on));
  const int world = parts_.control->world_size();
  rows_.resize(size_t(world) * width);
  const Tensor gathered = as_halves(rows_.data(), rows_.size(), nullptr);
  const auto done = parts_.control->all_gather(
      control_key(CollectiveKind::kAllGather, ControlPurpose::kNorms, gathered.numel()),
      as_halves(box.slot(0), width, box.buffer()), gathered);
  b.host_wait(*done);  // the step's one blocking wait: the host decides on the sums
  Exchanged out;
  bool diverged = false;
  std::string with_sum_on;  // ranks whose row carries the sum
  int with_sum_ranks = 0;
  std::vector<uint64_t> any(bits.size(), 0);
  out.unit_flags.assign(unit_flags_.size(), 0.0f);
  for (int r = 0; r < world; ++r) {  // in rank order, so every rank gets the same bits
    const double* theirs = rows_.data() + size_t(r) * width;
    out.sum_of_squares += theirs[kSum];
    out.changes += int64_t(theirs[kChanges]);
    diverged |= theirs[kFingerprint] != fingerprint;
    if (theirs[kWithSum] != 0.0) {
      with_sum_on += (with_sum_on.empty() ? "" : ", ") + std::to_string(r);
      ++with_sum_ranks;
    }
    const int64_t refused = int64_t(theirs[kRefused]);
    if (refused != 0 && (out.refused == 0 || refused < out.refused)) out.refused = refused;
    for (size_t w = 0; w < any.size(); ++w) any[w] |= uint64_t(theirs[kHead + w]);
    for (size_t i = 0; i < out.unit_flags.size(); ++i) out.unit_flags[i] += float(theirs[flags_at + i]);
  }
  std::vector<CollectiveKey> trace;
  for (CommQueue* queue : {parts_.data, parts_.reductions}) {
    if (queue == nullptr) continue;
    if (diverged) {  // the data queue's keys, then the reductions'
      const std::vector<CollectiveKey> keys = queue->trace();
      trace.insert(trace.end(), keys.begin(), keys.end());
    }
    queue->restart_trace();
  }
  if (diverged) {
    throw CollectiveOrderDiverged(
        "zerocore: ranks issued different collectives since the last step (their order fingerprints differ). "
        "Nothing was updated. Every rank must issue the same collectives in the same order.",
        std::move(trace));
  }
  if (with_sum_ranks != 0 && with_sum_ranks != world) {
    throw InvalidArgument(
        "zerocore: ranks took this step's grads differently: ranks " + with_sum_on +
        " read their norm (engine.clip_grad_norm_, or Config(max_grad_norm)) and the others did not. Nothing was "
        "updated. Call engine.clip_grad_norm_ on every rank, with the same max_norm, or on none.");
  }
  for (size_t i = 0; i < late.size(); ++i) late[i] = (any[i / kLateBits] >> (i % kLateBits)) & 1u;
  if (!parts_.partitioned) {  // every rank holds all the grads: its own row's sum, as it crossed
    out.sum_of_squares = rows_[size_t(parts_.control->rank()) * width + kSum];
  }
  return out;
}

const Exchanged& ZeroStep::exchange(int64_t changes) { return take_grads(changes, true); }

const Exchanged& ZeroStep::take_grads(int64_t changes, bool with_sum) {
  if (exchanged_) return *exchanged_;
  if (parts_.grad_reduce != nullptr) parts_.grad_reduce->run();
  BucketReducer* reducer = parts_.grad_reducer;
  std::vector<bool> late = reducer ? reducer->late() : std::vector<bool>{};
  // Stage 3's end-of-step round rides on the exchange: its flags do not
  // change before the round settles, after the update.
  unit_flags_ = parts_.units ? parts_.units->step_round_flags() : std::vector<float>{};
  // With the sum the host waits for the device anyway: it reads every
  // verdict left first, so that an update it applies (without the flag)
  // never follows a step the device refused.
  const int64_t seen = verdict_.read(with_sum);
  if (seen != 0 && (verdict_read_ == 0 || seen < verdict_read_)) verdict_read_ = seen;
  Mailbox& box = *row_;
  Stream* summed_on = nullptr;
  if (parts_.host_update != nullptr) {  // offload: the sum of the host grads, on the host update's stream
    parts_.host_update->take_grads();
    if (with_sum) {
      summed_on = &parts_.host_update->after_grads();
      backend().sum_of_squares(*summed_on, parts_.host_update->grads(), box, kSum, kFinite);
    }
  } else if (with_sum) {
    summed_on = &backend().compute_stream();
    backend().sum_of_squares(*summed_on, grads_, box, kSum, kFinite);
  }
  Exchanged agreed = exchange_rows(changes, late, summed_on);
  reduced_late_ = std::find(late.begin(), late.end(), true) != late.end();
  if (reduced_late_) {
    // Grads came after their bucket was reduced (reentrant checkpointing),
    // on some rank: every rank reduces those buckets, so all issue the same
    // collectives, and the sums are exchanged again, since they changed.
    // The reducer's partitions are the grads this rank's sum is over.
    reducer->reduce_late(late);
    if (with_sum) {
      reducer->grad_sum_of_squares(box, kSum, kFinite);
      late.assign(late.size(), false);
      agreed = exchange_rows(changes, late, &backend().compute_stream());
    }
  }
  exchanged_ = agreed;
  return *exchanged_;
}

bool ZeroStep::decides_on_device(const StepOptions& options) const {
  const bool dynamic = parts_.loss_scaler != nullptr && parts_.loss_scaler->dynamic();
  return !options.max_norm && !dynamic && !options.exact;
}

void ZeroStep::refuse(int64_t first, int64_t last, bool found_now) {
  verdict_.clear();
  verdict_read_ = 0;
  refused_step_ = first;
  // options.step counts this step too (Adam's bias correction); the user's engine.step_count does not.
  if (found_now) {
    throw NonFiniteGradients("zerocore: gradients hold inf/NaN, so this step was not applied (engine.step_count stays " +
                             std::to_string(first - 1) + "): params and optimizer state are unchanged. " +
                             kNonFiniteAdvice);
  }
  throw NonFiniteGradients(
      "zerocore: the gradients of step " + std::to_string(first) +
      " held inf/NaN (found on the device, read since), so no update was applied from that step to step " +
      std::to_string(last) + " (engine.step_count is back to " + std::to_string(first - 1) +
      "): params and optimizer state are as that step found them. " + kNonFiniteAdvice);
}

void ZeroStep::settle() {
  const int64_t seen = verdict_.read(true);
  if (seen != 0 && (verdict_read_ == 0 || seen < verdict_read_)) verdict_read_ = seen;
  // Every rank has read every verdict now: they agree without an exchange.
  if (verdict_read_ != 0) refuse(verdict_read_, last_step_, false);
}

StepResult ZeroStep::step(const StepOptions& options) {
  const bool on_device = !exchanged_ && decides_on_device(options);
  const Exchanged agreed = take_grads(options.changes, !on_device);
  if (agreed.refused != 0) refuse(agreed.refused, last_step_, false);  // nothing of this step is done yet
  if (agreed.changes != 0) {
    throw TrainabilityChanged("zerocore: " + std::to_string(agreed.changes) +
                              " trainability change(s) since the layout was planned; nothing was updated");
  }
  StepResult out;
  LossScaler* scaler = parts_.loss_scaler;
  // Deterministic mode (options.exact) brings its own sum: of the mean over every rank's micro-batches.
  const double sum_of_squares = options.exact ? options.exact->sum_of_squares : agreed.sum_of_squares;
  double grad_scale = 1.0 / ((options.exact ? 1 : parts_.data->world_size()) * loss_scale());
  out.norm = on_device ? std::nan("") : std::sqrt(sum_of_squares) * grad_scale;
  const bool finite = on_device || std::isfinite(sum_of_squares);
  out.applied = finite && !(options.exact && options.exact->regrid);
  Backend& b = backend();
  if (on_device) {
    if (parts_.host_update != nullptr) {  // offload: the host grads, on the host update's stream
      parts_.host_update->after_grads();
      verdict_.count(parts_.host_update->grads());
    } else {
      verdict_.count(reduced_late_ ? parts_.grad_reducer->partitions() : grads_);
    }
    if (parts_.partitioned && parts_.data->world_size() > 1) {  // every rank's count, summed
      b.wait(parts_.data->stream(), *b.record(verdict_.stream()));
      b.wait(verdict_.stream(), *parts_.data->all_reduce(kVerdictKey, verdict_.flag(), false));
    }
  }
  if (!out.applied) {
    if (finite) {
      // A finite grad outside the exact sum's grid: no loss scale to back off.
    } else if (scaler == nullptr || !scaler->dynamic()) {
      refuse(options.step, options.step, true);
    } else {
      scaler->update(true);  // backs off; throws at the minimum scale
    }
    // The next forward reads a pending update's params (and, in stages 1-2,
    // every rank's); stage 3's end-of-step round below releases any unit
    // gathered from the shards they replace.
    if (parts_.host_update != nullptr && parts_.host_update->params_up() && parts_.param_gather != nullptr) {
      parts_.param_gather->run();
    }
  } else {
    if (options.max_norm) grad_scale *= std::min(1.0, *options.max_norm / (out.norm + 1e-6));
    Tensor skip_if;
    if (on_device) {
      skip_if = verdict_.skip_if();
      verdict_.note(options.step);
      last_step_ = options.step;
    }
    if (!parts_.runs.empty()) {  // (offload's partition is the host update's, below)
      if (options.kind == OptimizerKind::kSgd) {
        b.sgd_update_runs(b.compute_stream(), options.sgd, options.step, grad_scale, parts_.runs, skip_if);
      } else {
        b.adam_update_runs(b.compute_stream(), options.adam, options.step, grad_scale, parts_.runs, skip_if);
      }
    }
    if (parts_.host_update != nullptr) parts_.host_update->apply(options, grad_scale, skip_if);
    if (parts_.param_gather != nullptr) parts_.param_gather->run();
    // On the CPU backends the verdict is there at once, on every rank alike.
    if (on_device && b.compute_runs_inline() && verdict_.read(false) != 0) refuse(options.step, options.step, true);
    if (scaler != nullptr) scaler->update(false);
    out.grad_scale = grad_scale;
  }
  exchanged_.reset();
  if (parts_.units != nullptr) parts_.units->end_step(agreed.unit_flags);  // the next forward's first units, updated
  return out;
}

}  // namespace zerocore
