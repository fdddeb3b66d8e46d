#include "zerocore/offload/offload_optimizer.h"

#include <string>
#include <utility>

#include "zerocore/error.h"
#include "zerocore/kernels/cpu_reduce.h"
#include "zerocore/kernels/optim_args.h"

namespace zerocore {

namespace {

constexpr const char* kOp = "OffloadOptimizer";

void check_copies(const std::vector<TensorCopy>& copies, const char* what) {
  for (const TensorCopy& c : copies) {
    if (c.src.dtype() != c.dst.dtype() || c.src.numel() != c.dst.numel()) {
      throw InvalidArgument(std::string(kOp) + ": a " + what + " copy's source and destination differ (" +
                            std::to_string(c.src.numel()) + " " + dtype_name(c.src.dtype()) + " elements to " +
                            std::to_string(c.dst.numel()) + " " + dtype_name(c.dst.dtype()) + ")");
    }
  }
}

// What the host update reads or writes must be host memory: on CUDA a
// device tensor here would be read by the CPU kernels.
void check_on_host(const Tensor& t, size_t bucket, const std::string& what) {
  if (is_given(t) && t.device().type != DeviceType::kCPU) {
    throw TypeMismatch(std::string(kOp) + ": bucket " + std::to_string(bucket) + "'s " + what + " is on cuda:" +
                       std::to_string(t.device().index) + "; the host update reads and writes host memory");
  }
}

void check_bucket(const OffloadBucket& b, size_t index) {
  check_copies(b.grads_down, "grad");
  check_copies(b.params_up, "param");
  if (!b.spare_grads.empty() && b.spare_grads.size() != b.runs.size()) {
    throw InvalidArgument(std::string(kOp) + ": a bucket has " + std::to_string(b.spare_grads.size()) +
                          " spare grads for " + std::to_string(b.runs.size()) + " runs");
  }
  for (size_t i = 0; i < b.runs.size(); ++i) {
    const FlatRun& r = b.runs[i];
    const std::string run = "run " + std::to_string(i) + " ";
    check_on_host(r.param, index, run + "param");
    check_on_host(r.grad, index, run + "grad");
    check_on_host(r.state0, index, run + "state0");
    check_on_host(r.state1, index, run + "state1");
    check_on_host(r.param_copy, index, run + "param_copy");
    if (!b.spare_grads.empty()) {
      check_copies({TensorCopy{r.grad, b.spare_grads[i]}}, "spare grad");
      check_on_host(b.spare_grads[i], index, run + "spare grad");
    }
  }
  for (const TensorCopy& c : b.grads_down) check_on_host(c.dst, index, "grad copy's destination");
  for (const TensorCopy& c : b.params_up) check_on_host(c.src, index, "param copy's source");
}

}  // namespace

OffloadOptimizer::OffloadOptimizer(std::vector<OffloadBucket> buckets, Backend& backend)
    : OffloadOptimizer(std::move(buckets), backend, backend.create_stream("offload copy"),
                       backend.create_stream("offload update")) {}

OffloadOptimizer::OffloadOptimizer(std::vector<OffloadBucket> buckets, Backend& backend, Stream& copy,
                                   Stream& update)
    : buckets_(std::move(buckets)), backend_(backend), copy_(copy), update_(update), grads_down_(buckets_.size()) {
  for (size_t k = 0; k < buckets_.size(); ++k) {
    check_bucket(buckets_[k], k);
    for (const FlatRun& run : buckets_[k].runs) grads_.push_back(run.grad);
  }
}

OffloadOptimizer::~OffloadOptimizer() {
  // As joining its own threads did: once the optimizer is gone, nothing of
  // its work still touches the caller's buffers.
  try {
    wait();
  } catch (...) {  // NOLINT: an error was the caller's to see at wait(); a destructor cannot raise it
  }
}

void OffloadOptimizer::swap_grads() {
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

void OffloadOptimizer::order(Stream& stream, Stream& after) { backend_.wait(stream, *backend_.record(after)); }

void OffloadOptimizer::copy_all(const std::vector<TensorCopy>& copies) {
  for (const TensorCopy& c : copies) backend_.copy(copy_, c.dst, c.src);
}

void OffloadOptimizer::copy_grads() {
  bool ordered = false;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    if (buckets_[k].grads_down.empty()) continue;
    if (!ordered) {
      order(copy_, backend_.compute_stream());  // the grads were reduced there
      if (last_update_) backend_.wait(copy_, *last_update_);  // it reads the host grads
      ordered = true;
    }
    copy_all(buckets_[k].grads_down);
    grads_down_[k] = backend_.record(copy_);
  }
  if (ordered) last_copy_ = backend_.record(copy_);
}

void OffloadOptimizer::copy_params() {
  bool ordered = false;
  for (const OffloadBucket& b : buckets_) {
    if (b.params_up.empty()) continue;
    if (!ordered) {
      order(copy_, backend_.compute_stream());  // training read the params there until now
      if (last_update_) backend_.wait(copy_, *last_update_);
      ordered = true;
    }
    copy_all(b.params_up);
  }
  if (ordered) last_copy_ = backend_.record(copy_);
}

void OffloadOptimizer::hand_to_compute() {
  Stream& compute = backend_.compute_stream();
  order(compute, update_);  // the update read the host grads and wrote the params the copies send
  order(compute, copy_);
}

Stream& OffloadOptimizer::after_grads() {
  order(update_, backend_.compute_stream());  // the reducer's adds into the host grads (stages 2-3)
  for (std::shared_ptr<StreamEvent>& down : grads_down_) {
    if (down) backend_.wait(update_, *down);
    down.reset();
  }
  return update_;
}

template <class Options, class Update>
void OffloadOptimizer::update(const std::vector<Options>& groups, bool copy_params, Update update_bucket) {
  for (const OffloadBucket& b : buckets_) {
    for (const FlatRun& run : b.runs) {
      if (run.param_group < 0 || size_t(run.param_group) >= groups.size()) {
        throw InvalidArgument("OffloadOptimizer: a run is in param group " + std::to_string(run.param_group) +
                              ", but " + std::to_string(groups.size()) + " group(s) were given");
      }
    }
  }
  // The compute stream reduced the grads the update reads and read the
  // params the copies overwrite.
  order(update_, backend_.compute_stream());
  if (copy_params) order(copy_, backend_.compute_stream());
  bool updated = false, copied = false;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const OffloadBucket& b = buckets_[k];
    if (b.runs.empty()) continue;
    // Only this bucket's grads: the param copies queued between them on
    // the copy stream do not hold the update back.
    if (grads_down_[k]) backend_.wait(update_, *grads_down_[k]);
    grads_down_[k].reset();
    update_bucket(b.runs);
    updated = true;
    if (copy_params && !b.params_up.empty()) {
      order(copy_, update_);
      copy_all(b.params_up);
      copied = true;
    }
  }
  if (updated) last_update_ = backend_.record(update_);
  if (copied) last_copy_ = backend_.record(copy_);
}

void OffloadOptimizer::adam(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                            bool copy_params, const Tensor& skip_if) {
  for (const AdamOptions& g : groups) adam_coefs(g, step, grad_scale);  // throws on a bad value, before queueing
  update(groups, copy_params, [&](const std::vector<FlatRun>& runs) {
    backend_.adam_update_runs(update_, groups, step, grad_scale, runs, skip_if);
  });
}

void OffloadOptimizer::sgd(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                           bool copy_params, const Tensor& skip_if) {
  for (const SgdOptions& g : groups) sgd_coefs(g, step, grad_scale);
  update(groups, copy_params, [&](const std::vector<FlatRun>& runs) {
    backend_.sgd_update_runs(update_, groups, step, grad_scale, runs, skip_if);
  });
}

void OffloadOptimizer::wait() {
  // A stream fails every job after a failed one, so the last events raise
  // the first error; they are kept until a wait succeeds.
  if (last_update_) backend_.host_wait(*last_update_);
  if (last_copy_) backend_.host_wait(*last_copy_);
  last_update_.reset();
  last_copy_.reset();
}

bool OffloadOptimizer::busy() const {
  return (last_update_ && !backend_.query(*last_update_)) || (last_copy_ && !backend_.query(*last_copy_));
}

double OffloadOptimizer::grad_sum_of_squares() const {
  for (const Tensor& g : grads_) {
    backend_.declare_host_access(Access::read(g), "host reads grads");
  }
  return sum_of_squares(grads_);
}

}  // namespace zerocore
