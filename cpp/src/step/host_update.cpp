#include "zerocore/step/host_update.h"

namespace zerocore {

HostUpdate::HostUpdate(OffloadOptimizer& optimizer, bool swaps_grads, std::optional<int64_t> delays_from)
    : optimizer_(optimizer), swaps_grads_(swaps_grads), delays_from_(delays_from) {}

void HostUpdate::take_grads() {
  if (swaps_grads_) {
    // The grads just reduced become the update's, and the buffer a pending
    // update reads the next backward's, which the compute stream runs
    // behind that update's params up.
    optimizer_.swap_grads();
    ++grad_swaps_;
  } else {
    optimizer_.copy_grads();
  }
}

void HostUpdate::apply(const StepOptions& options, double grad_scale, const Tensor& skip_if) {
  params_up();
  const bool delayed = delays_from_ && options.step >= *delays_from_;
  const bool overlap = !(delayed || serial);
  if (options.kind == OptimizerKind::kSgd) {
    optimizer_.sgd(options.sgd, options.step, grad_scale, overlap, skip_if);
  } else {
    optimizer_.adam(options.adam, options.step, grad_scale, overlap, skip_if);
  }
  params_sent_ += overlap;
  pending_ = !overlap;
  // Serial: its params go up now, once the update is done. Delayed: at the
  // next step boundary; until then the next forward reads the last ones.
  if (!delayed && !params_up()) optimizer_.hand_to_compute();
}

bool HostUpdate::params_up() {
  if (!pending_) return false;
  optimizer_.copy_params();
  optimizer_.hand_to_compute();
  pending_ = false;
  ++params_sent_;
  return true;
}

bool HostUpdate::finish() {
  const bool had = params_up();
  optimizer_.wait();
  return had;
}

}  // namespace zerocore
