// ZeRO-Offload's step: the optimizer runs on the host, over fp32 master
// params and states kept in host memory, while the params training reads
// stay where training runs (the device).
//
// A rank's partition is cut into buckets. Two in-order queues, each on its
// own native thread (never holding the Python GIL), move the work along:
//
//   copy queue:    grads down (device -> host), params up (host -> device)
//   update queue:  the CPU optimizer (SIMD kernels on the thread pool),
//                  one bucket at a time
//
// In a step the update of bucket k+1 runs while bucket k's new params are
// copied up, so the copies hide behind the update. A caller that wants the
// params to stay as they are (the delayed parameter update: step t's update
// runs during step t+1's forward and backward) queues the update without
// the copies and copies the params up at the next step boundary.
//
// On the CPU backend "device" and "host" are both host memory and a copy is
// a memcpy on the copy queue's thread; the CUDA backend puts the copies on a
// copy stream between pinned host memory and the device.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/runtime/event.h"
#include "zerocore/tensor.h"
#include "zerocore/runtime/work_queue.h"

namespace zerocore {

// dst <- src: same dtype, same number of elements.
struct TensorCopy {
  Tensor src, dst;
};

struct OffloadBucket {
  std::vector<FlatRun> runs;          // host: fp32 master, grad, states, 16-bit copy
  std::vector<TensorCopy> grads_down; // where the runs' host grads come from (none: they are written there)
  std::vector<TensorCopy> params_up;  // the runs' new params -> the params training reads
  // Per run, a second host grad of the same dtype and size, or none: where
  // reduction writes while an update reads the run's grad (swap_grads).
  std::vector<Tensor> spare_grads;
};

class OffloadOptimizer {
 public:
  // Throws InvalidArgument when a copy's two sides differ in dtype or size.
  explicit OffloadOptimizer(std::vector<OffloadBucket> buckets);
  ~OffloadOptimizer();  // waits for the work in flight
  OffloadOptimizer(const OffloadOptimizer&) = delete;
  OffloadOptimizer& operator=(const OffloadOptimizer&) = delete;

  // Queues every bucket's grads_down on the copy queue.
  // They wait for the updates queued before, which read the host grads.
  void copy_grads();
  // Queues the update of every bucket, in order, behind the copies queued
  // before (the grads it reads); with copy_params, each
  // bucket's params_up follows its update on the copy queue. The options
  // are checked here, before anything is queued (InvalidArgument).
  void adam(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale, bool copy_params);
  void sgd(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale, bool copy_params);
  // Queues every bucket's params_up, behind the updates queued before.
  void copy_params();
  // Returns once everything queued has run; rethrows the first error.
  // After an error every later call fails with it too.
  void wait();
  bool busy() const;  // work queued and not yet waited for
  // Each run's grad and its spare trade places: the grads the last
  // backward reduced into the spares become the ones the next update
  // reads, without a copy, and the old ones are free for the next
  // backward. Only when nothing is queued (InvalidArgument otherwise:
  // wait() first) and every bucket has spares.
  void swap_grads();

  // The sum of squares of the runs' host grads, in fp64 (after wait()).
  double grad_sum_of_squares() const;

 private:
  template <class Options, class Update>
  void update(const std::vector<Options>& groups, bool copy_params, Update update_bucket);
  static void run_copies(const std::vector<TensorCopy>& copies);

  std::vector<OffloadBucket> buckets_;
  std::vector<Tensor> grads_;  // every run's host grad
  // Declared after the buckets, so they are joined before the buffers go.
  WorkQueue update_queue_, copy_queue_;
  // The last job queued on each: a job that must follow work on the other
  // queue waits for its event (the queues themselves run in order).
  std::shared_ptr<Event> last_update_, last_copy_;
};

}  // namespace zerocore
