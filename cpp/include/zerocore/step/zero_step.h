// The optimizer step of a ZeRO rank, in one call: finish the grads'
// reduction (stages 0-1's bucketed all-reduce / reduce-scatter), this
// rank's sum of squares, the step's ONE control collective (the global sum
// of squares, trainability changes, the data queue's order fingerprint and
// which grad buckets got grads after their reduction, together), the
// decision (skip or refuse non-finite grads, with the loss scaler's
// bookkeeping; the grad scale 1/(world*loss_scale) times the clip
// coefficient), the update of the partition's runs and, in stages 1-2, the
// all-gather of the updated params, or in stage 3 the unit schedule's
// end-of-step round. The Python engine and C++ embedders
// (cpp/examples/embed_zero.cpp) step through it alike. With ZeRO-Offload
// the host update (HostUpdate, step/host_update.h) runs inside the call
// too: the step takes its host grads' sum of squares and runs its update,
// never calling back into the caller. What is left to the caller is naming
// where ranks parted when their orders differ (the caller knows its
// collectives' names).
//
// clip_grad_norm_ needs the norm before the step: exchange() runs the
// reduction and the exchange once a step, and step() does not repeat it.
//
// Where the host must read the norm (dynamic loss scaling, clipping), the
// sum of squares is a kernel on the compute stream (offload: the host
// update's) into this rank's row of the exchange, a mailbox the control
// queue's all-gather reads once its stream waited for that stream: the
// host waits for the device once a step. Elsewhere the step decides on the
// device (DeviceVerdict, offload's update included): the exchange carries host facts only, the grads'
// finiteness is a flag the update kernels read, and a refused step is
// answered at a later exchange, on every rank together (docs/runtime.md,
// "The step").
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "zerocore/backend/mailbox.h"
#include "zerocore/comm/comm.h"
#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/kernels/optim.h"
#include "zerocore/schedule/bucket_collectives.h"
#include "zerocore/schedule/bucket_reducer.h"
#include "zerocore/schedule/unit_schedule.h"
#include "zerocore/step/device_verdict.h"
#include "zerocore/step/loss_scaler.h"

namespace zerocore {

// Ranks issued different data-plane collectives since the last step:
// thrown on every rank by the exchange, before anything is updated. It
// carries this rank's trace (the data queue starts afresh), so that the
// caller, who knows its collectives' names, can exchange the traces and
// name where ranks parted (python/zerocore/comm/communicator.py does).
class CollectiveOrderDiverged : public std::runtime_error {
 public:
  CollectiveOrderDiverged(const std::string& what, std::vector<CollectiveKey> trace)
      : std::runtime_error(what), trace(std::move(trace)) {}
  std::vector<CollectiveKey> trace;
};

// A param's requires_grad changed since the layout was planned, on some
// rank (the exchange's `changes`, summed): thrown by step() on every rank,
// before anything is updated; the caller names the params.
class TrainabilityChanged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class OptimizerKind { kAdam, kSgd };

// The data-plane group id of the ranks' sum of the step's verdict flags
// (DeviceVerdict): beyond every flat group's.
constexpr int32_t kStepVerdictGroup = INT32_MAX;  // Adam or AdamW: AdamOptions::adamw

// This step's hyperparameters, one entry per optimizer param group (read
// from the optimizer each step: schedulers change them).
struct StepOptions {
  OptimizerKind kind = OptimizerKind::kAdam;
  std::vector<AdamOptions> adam;  // kAdam
  std::vector<SgdOptions> sgd;    // kSgd
  int64_t step = 1;               // the optimizer step this one becomes, if applied
  std::optional<double> max_norm; // clip to this global L2 norm (the smaller of the caller's bounds)
  int64_t changes = 0;            // this rank's trainability changes (the exchange's, if step() runs it)
  // Config(deterministic=True) (python/zerocore/state/exact_grads.py): the caller
  // summed the grads exactly and left their mean over every micro-batch of
  // every rank in the grad buffers, so the update does not divide by the
  // world size, and these replace what the exchange summed.
  struct Exact {
    double sum_of_squares = 0.0;  // of the mean (loss-scaled) grads, the same at any world size
    bool regrid = false;          // a grad fell outside the step's grid: skipped on every rank
  };
  std::optional<Exact> exact;
};

// What the exchange agreed, the same on every rank.
struct Exchanged {
  double sum_of_squares = 0.0;  // of the reduced, loss-scaled grads (when read); non-finite when any grad is
  int64_t changes = 0;          // trainability changes, summed over ranks
  std::vector<float> unit_flags;  // stage 3's end-of-step round, summed over ranks
  int64_t refused = 0;  // the first step the device refused that some rank has read of (0: none)
};

struct StepResult {
  // false: the grads were not finite; the step was skipped (dynamic loss
  // scaling). Decided on the device: true, unless a later exchange finds
  // the device refused it (NonFiniteGradients then, naming the step).
  bool applied = false;
  double norm = 0.0;     // the global L2 norm of the unscaled grads (before clipping); NaN: not read
  double grad_scale = 0.0;  // what the update multiplied the grads by (applied steps)
};

class HostUpdate;  // step/host_update.h

class ZeroStep {
 public:
  struct Parts {
    CommQueue* data = nullptr;     // the data collectives: its fingerprint is checked
    CommQueue* control = nullptr;  // the exchange's queue (a host process group beside the data one)
    std::vector<FlatRun> runs;     // this rank's partition; empty with a host_update (offload)
    // True when ranks hold disjoint parts of the grads (stages 1-3): the
    // sum of squares is summed over ranks; otherwise every rank has them all.
    bool partitioned = false;
    BucketCollectives* grad_reduce = nullptr;    // stages 0-1: the step's reduction, if any
    BucketCollectives* param_gather = nullptr;   // stages 1-2: updated params to every rank
    // Stages 2-3: the reducer whose late grads (staged after their bucket
    // was reduced) the exchange agrees on and reduces (set_grad_reducer).
    BucketReducer* grad_reducer = nullptr;
    UnitSchedule* units = nullptr;      // stage 3: its end-of-step round, carried by the exchange
    LossScaler* loss_scaler = nullptr;  // the loss scale and its bookkeeping; nullptr: none (1)
    // Offload (runs empty): the partition lives on the host. The step takes
    // its grads once the reduction is done (their sum or verdict on its
    // stream), and queues its update between the decision and the param
    // gather; a skipped step lets a pending (delayed) update's params go up
    // instead, since the next forward must read them.
    HostUpdate* host_update = nullptr;
    // Stages 2-3: the reducer's queue, where it is not `data` (reductions on
    // a stream and group of their own, so no gather waits behind one): its
    // order fingerprint is checked with the data queue's.
    CommQueue* reductions = nullptr;
  };

  explicit ZeroStep(Parts parts);

  // Once a step (later calls return the first's result until step() or
  // forget()): finishes the reduction, takes this rank's sum of squares
  // and exchanges it with `changes`, the order fingerprint and the late
  // grads' buckets; if any rank has late grads, every rank reduces those
  // buckets and the exchange runs again (the sums changed). Throws
  // CollectiveOrderDiverged on every rank when the fingerprints differ.
  const Exchanged& exchange(int64_t changes = 0);

  // exchange() first if not yet this step (without the sum where the step
  // decides on the device); TrainabilityChanged when any rank noted
  // changes; then the decision. Finite grads: the update, the param
  // gather, the loss scaler's clean step. Non-finite: with dynamic loss
  // scaling the step is skipped (applied = false) and the scale backs off;
  // otherwise, or at the minimum scale, NonFiniteGradients, with nothing
  // changed. Decided on the device, the update is skipped there and the
  // error comes at the first exchange after some rank read the verdict
  // (at once on the CPU backends), naming the step; every step since was
  // skipped too. Either way (but the throw) stage 3's end-of-step round
  // follows and the next step exchanges afresh.
  StepResult step(const StepOptions& options);
  // Every verdict of the device not read yet, waiting for it (before the
  // params or states are read: a checkpoint, the final params); throws
  // NonFiniteGradients as step() would. Call it on every rank.
  void settle();
  // The first step refused by the last NonFiniteGradients (0: none yet):
  // the step count to go back to is one less.
  int64_t refused_step() const { return refused_step_; }

  // The reducer was rebuilt (a test reorders the reduction on one rank).
  void set_grad_reducer(BucketReducer* reducer);
  // The grads were dropped (zero_grad): the next step exchanges afresh.
  void forget() { exchanged_.reset(); }
  bool exchanged() const { return exchanged_.has_value(); }
  double loss_scale() const { return parts_.loss_scaler ? parts_.loss_scaler->scale() : 1.0; }
  // The step's own buffers, allocated with the step, not in it: in host
  // memory (pinned) this rank's row of the exchange and the verdict's
  // readbacks, in device memory the verdict's flag.
  size_t buffer_bytes() const { return row_->buffer()->bytes() + verdict_.host_bytes(); }
  size_t device_buffer_bytes() const { return verdict_.device_bytes(); }

 private:
  Backend& backend() const { return parts_.data->backend(); }
  // (Re)allocates this rank's row for the reducer's buckets (one late bit
  // each); its sum of squares is the caller's to write (in some stream's
  // order) before exchange_rows.
  void size_row();
  size_t late_words() const;  // the row's doubles of late-bucket bits
  // One exchange of (sum of squares, written on `summed_on`, if given;
  // changes, fingerprint, verdicts read, late buckets, unit flags) rows;
  // returns the agreed sums and sets `late` to the buckets late on any
  // rank. Throws CollectiveOrderDiverged, and InvalidArgument where ranks
  // differ on whether they carry the sum.
  Exchanged exchange_rows(int64_t changes, std::vector<bool>& late, Stream* summed_on);
  // exchange(), the sum taken and exchanged only `with_sum`.
  const Exchanged& take_grads(int64_t changes, bool with_sum);
  // The data queue's order fingerprint, folded with the reductions' queue's.
  uint64_t fingerprint_of_queues() const;
  // Whether this step decides on the device: the host reads nothing.
  bool decides_on_device(const StepOptions& options) const;
  // Step `first` was refused (agreed on every rank), and every step after
  // it to `last`: the flag is cleared and NonFiniteGradients thrown, naming
  // them (found_now: found by this step itself, first == last).
  [[noreturn]] void refuse(int64_t first, int64_t last, bool found_now);

  Parts parts_;
  std::vector<Tensor> grads_;    // the runs' grads, for the sum of squares
  std::unique_ptr<Mailbox> row_; // this rank's row of the exchange
  std::vector<double> rows_;     // the exchange's gathered rows
  std::vector<float> unit_flags_;  // this rank's flags of stage 3's end-of-step round, this step
  std::optional<Exchanged> exchanged_;
  DeviceVerdict verdict_;
  int64_t verdict_read_ = 0;  // the first refused step this rank read of, not yet answered
  int64_t last_step_ = 0;     // the newest step decided on the device
  int64_t refused_step_ = 0;
  bool reduced_late_ = false;  // this step's exchange reduced late grads: the reducer's partitions hold them
};

}  // namespace zerocore
