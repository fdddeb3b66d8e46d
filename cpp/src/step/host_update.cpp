#include "zerocore/step/host_update.h"

namespace zerocore {

HostUpdate::HostUpdate(OffloadOptimizer& optimizer, bool swaps_grads, std::optional<int64_t> delays_from)
    : optimizer_(optimizer), swaps_grads_(swaps_grads), delays_from_(delays_from) {}

double HostUpdate::grad_sum_of_squares() {
  optimizer_.wait_for_compute();  // stages 2-3: the reducer's adds into the host grads
  if (swaps_grads_) {
    // The grads just reduced become the update's, and the buffer a pending
    // update reads (waited for) the next backward's.
    optimizer_.wait();
    optimizer_.swap_grads();
    ++grad_swaps_;
  } else {
    optimizer_.copy_grads();  // behind a pending update, which reads the host grads
    optimizer_.wait();
  }
  return optimizer_.grad_sum_of_squares();
}

void HostUpdate::apply(const StepOptions& options, double grad_scale) {
  params_up();
  const bool delayed = delays_from_ && options.step >= *delays_from_;
  const bool overlap = !(delayed || serial);
  if (options.kind == OptimizerKind::kSgd) {
    optimizer_.sgd(options.sgd, options.step, grad_scale, overlap);
  } else {
    optimizer_.adam(options.adam, options.step, grad_scale, overlap);
  }
  params_sent_ += overlap;
  pending_ = !overlap;
  if (!delayed) {
    optimizer_.wait();
    params_up();
  }
}

bool HostUpdate::params_up() {
  if (!pending_) return false;
  optimizer_.copy_params();
  optimizer_.wait();
  pending_ = false;
  ++params_sent_;
  return true;
}

}  // namespace zerocore
