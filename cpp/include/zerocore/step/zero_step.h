// The optimizer step of a ZeRO rank, in one call: finish the grads'
// reduction (stages 0-1's bucketed all-reduce / reduce-scatter), this
// rank's sum of squares, the step's ONE control collective (the global sum
// of squares, trainability changes and the data queue's order fingerprint
// together), the decision (skip or refuse non-finite grads; the grad scale
// 1/(world*loss_scale) times the clip coefficient), the update of the
// partition's runs and, in stages 1-2, the all-gather of the updated
// params. The Python engine and C++ embedders (cpp/examples/embed_zero.cpp)
// step through it alike; what is left to the caller is what it owns: the
// loss scaler's bookkeeping, stage 3's end-of-step round, and naming where
// ranks parted when their orders differ (the caller knows its collectives'
// names).
//
// clip_grad_norm_ needs the norm before the step: exchange() runs the
// reduction and the exchange once a step, and step() does not repeat it.
#pragma once
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/kernels/optim.h"
#include "zerocore/schedule/bucket_collectives.h"

namespace zerocore {

// Ranks issued different data-plane collectives since the last step:
// thrown on every rank by the exchange, before anything is updated. It
// carries this rank's trace (the data queue starts afresh), so that the
// caller, who knows its collectives' names, can exchange the traces and
// name where ranks parted (python/zerocore/comm.py does).
class CollectiveOrderDiverged : public std::runtime_error {
 public:
  CollectiveOrderDiverged(const std::string& what, std::vector<CollectiveKey> trace)
      : std::runtime_error(what), trace(std::move(trace)) {}
  std::vector<CollectiveKey> trace;
};

enum class OptimizerKind { kAdam, kSgd };  // Adam or AdamW: AdamOptions::adamw

// This step's hyperparameters, one entry per optimizer param group (read
// from the optimizer each step: schedulers change them).
struct StepOptions {
  OptimizerKind kind = OptimizerKind::kAdam;
  std::vector<AdamOptions> adam;  // kAdam
  std::vector<SgdOptions> sgd;    // kSgd
  int64_t step = 1;               // the optimizer step this one becomes, if applied
  double loss_scale = 1.0;        // the grads hold the sum over ranks of loss-scaled grads
  std::optional<double> max_norm; // clip to this global L2 norm (the smaller of the caller's bounds)
};

// What the exchange agreed, the same on every rank.
struct Exchanged {
  double sum_of_squares = 0.0;  // of the reduced, loss-scaled grads; non-finite when any grad is
  int64_t changes = 0;          // trainability changes, summed over ranks
};

struct StepResult {
  bool applied = false;  // false: the grads were not finite; nothing was updated
  double norm = 0.0;     // the global L2 norm of the unscaled grads (before clipping)
  double grad_scale = 0.0;  // what the update multiplied the grads by (applied steps)
};

class ZeroStep {
 public:
  struct Parts {
    CommQueue* data = nullptr;     // the data collectives: its fingerprint is checked
    CommQueue* control = nullptr;  // the exchange's queue (a host group beside the data group)
    std::vector<FlatRun> runs;     // this rank's partition; empty: the caller updates (offload)
    // True when ranks hold disjoint parts of the grads (stages 1-3): the
    // sum of squares is summed over ranks; otherwise every rank has them all.
    bool partitioned = false;
    BucketCollectives* grad_reduce = nullptr;    // stages 0-1: the step's reduction, if any
    BucketCollectives* param_gather = nullptr;   // stages 1-2: updated params to every rank
  };

  explicit ZeroStep(Parts parts);

  // Once a step (later calls return the first's result until step() or
  // forget()): finishes the reduction, takes this rank's sum of squares
  // (`local` instead, when the caller updates: offload) and exchanges it
  // with `changes` and the order fingerprint. Throws CollectiveOrderDiverged
  // on every rank when the fingerprints differ.
  const Exchanged& exchange(int64_t changes = 0, std::optional<double> local = std::nullopt);

  // The decision and, when the grads are finite, the update and the param
  // gather; exchange() first if not yet this step. Non-finite grads leave
  // everything untouched (applied = false), the exchange's result too, so
  // that calling step() again decides the same: the caller skips the step
  // (dynamic loss scaling: forget()) or raises.
  StepResult step(const StepOptions& options);

  // The grads were dropped (zero_grad): the next step exchanges afresh.
  void forget() { exchanged_.reset(); }
  bool exchanged() const { return exchanged_.has_value(); }

 private:
  Parts parts_;
  std::vector<Tensor> grads_;  // the runs' grads, for the sum of squares
  std::vector<double> rows_;   // the exchange's gathered rows: world x (sum of squares, changes, fingerprint)
  std::optional<Exchanged> exchanged_;
};

}  // namespace zerocore
