#include "zerocore/offload/offload_optimizer.h"

#include <cstring>
#include <string>
#include <utility>

#include "zerocore/kernels/cpu_reduce.h"
#include "zerocore/error.h"

namespace zerocore {

namespace {

void check_copies(const std::vector<TensorCopy>& copies, const char* what) {
  for (const TensorCopy& c : copies) {
    if (c.src.dtype() != c.dst.dtype() || c.src.numel() != c.dst.numel()) {
      throw InvalidArgument(std::string("OffloadOptimizer: a ") + what + " copy's source and destination differ (" +
                            std::to_string(c.src.numel()) + " " + dtype_name(c.src.dtype()) + " elements to " +
                            std::to_string(c.dst.numel()) + " " + dtype_name(c.dst.dtype()) + ")");
    }
  }
}

// A job that runs `work` once `after` (work on the other queue) is done.
template <class Work>
std::function<void()> after(std::shared_ptr<Event> event, Work work) {
  return [event = std::move(event), work = std::move(work)] {
    if (event) event->wait();
    work();
  };
}

}  // namespace

OffloadOptimizer::OffloadOptimizer(std::vector<OffloadBucket> buckets) : buckets_(std::move(buckets)) {
  for (const OffloadBucket& b : buckets_) {
    check_copies(b.grads_down, "grad");
    check_copies(b.params_up, "param");
    if (!b.spare_grads.empty()) {
      if (b.spare_grads.size() != b.runs.size()) {
        throw InvalidArgument("OffloadOptimizer: a bucket has " + std::to_string(b.spare_grads.size()) +
                              " spare grads for " + std::to_string(b.runs.size()) + " runs");
      }
      for (size_t i = 0; i < b.runs.size(); ++i) {
        check_copies({TensorCopy{b.runs[i].grad, b.spare_grads[i]}}, "spare grad");
      }
    }
    for (const FlatRun& run : b.runs) grads_.push_back(run.grad);
  }
}

void OffloadOptimizer::swap_grads() {
  if (busy()) throw InvalidArgument("OffloadOptimizer.swap_grads: work is queued; wait() first");
  for (const OffloadBucket& b : buckets_) {
    if (b.spare_grads.empty() && !b.runs.empty()) {
      throw InvalidArgument("OffloadOptimizer.swap_grads: a bucket has no spare grads");
    }
  }
  grads_.clear();
  for (OffloadBucket& b : buckets_) {
    for (size_t i = 0; i < b.runs.size(); ++i) {
      std::swap(b.runs[i].grad, b.spare_grads[i]);
      grads_.push_back(b.runs[i].grad);
    }
  }
}

OffloadOptimizer::~OffloadOptimizer() = default;

void OffloadOptimizer::run_copies(const std::vector<TensorCopy>& copies) {
  for (const TensorCopy& c : copies) std::memcpy(c.dst.data(), c.src.data(), c.src.nbytes());
}

void OffloadOptimizer::copy_grads() {
  for (const OffloadBucket& b : buckets_) {
    if (b.grads_down.empty()) continue;
    last_copy_ = copy_queue_.enqueue(after(last_update_, [copies = &b.grads_down] { run_copies(*copies); }));
  }
}

void OffloadOptimizer::copy_params() {
  for (const OffloadBucket& b : buckets_) {
    if (b.params_up.empty()) continue;
    last_copy_ = copy_queue_.enqueue(after(last_update_, [copies = &b.params_up] { run_copies(*copies); }));
  }
}

template <class Options, class Update>
void OffloadOptimizer::update(const std::vector<Options>& groups, bool copy_params, Update update_bucket) {
  for (const OffloadBucket& b : buckets_) {
    for (const FlatRun& run : b.runs) {
      if (run.group < 0 || size_t(run.group) >= groups.size()) {
        throw InvalidArgument("OffloadOptimizer: a run is in param group " + std::to_string(run.group) + ", but " +
                              std::to_string(groups.size()) + " group(s) were given");
      }
    }
  }
  // Every update waits for the copies queued before this call (the grads),
  // not for the param copies this call queues between them.
  const std::shared_ptr<Event> grads = last_copy_;
  for (const OffloadBucket& b : buckets_) {
    if (b.runs.empty()) continue;
    last_update_ = update_queue_.enqueue(after(grads, [runs = &b.runs, update_bucket] { update_bucket(*runs); }));
    if (copy_params && !b.params_up.empty()) {
      last_copy_ = copy_queue_.enqueue(after(last_update_, [copies = &b.params_up] { run_copies(*copies); }));
    }
  }
}

void OffloadOptimizer::adam(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                            bool copy_params) {
  for (const AdamOptions& g : groups) adam_coefs(g, step, grad_scale);  // throws on a bad value, before queueing
  update(groups, copy_params, [groups, step, grad_scale](const std::vector<FlatRun>& runs) {
    adam_update_runs(groups, step, grad_scale, runs);
  });
}

void OffloadOptimizer::sgd(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                           bool copy_params) {
  for (const SgdOptions& g : groups) sgd_coefs(g, step, grad_scale);
  update(groups, copy_params, [groups, step, grad_scale](const std::vector<FlatRun>& runs) {
    sgd_update_runs(groups, step, grad_scale, runs);
  });
}

void OffloadOptimizer::wait() {
  // The queues run in order and fail every job after a failed one, so
  // their last events cover everything queued.
  if (last_update_) last_update_->wait();
  if (last_copy_) last_copy_->wait();
}

bool OffloadOptimizer::busy() const {
  return (last_update_ && !last_update_->ready()) || (last_copy_ && !last_copy_->ready());
}

double OffloadOptimizer::grad_sum_of_squares() const { return sum_of_squares(grads_); }

}  // namespace zerocore
