// ZeRO-Offload's step: the optimizer runs on the host, over fp32 master
// params and states kept in host memory, while the params training reads
// stay where training runs (the device).
//
// A rank's partition is cut into buckets. The work runs on two streams of a
// backend (backend/backend.h), never holding the Python GIL:
//
//   copy stream:    grads down (device -> host), params up (host -> device)
//   update stream:  the CPU optimizer (SIMD kernels on the thread pool) over
//                   host memory, one bucket at a time
//
// and is ordered by the backend's events, not by the host:
//
//   compute --record--> copy:   the grads reduced, the params no longer read
//   copy    --bucket k--> update: bucket k's grads are down
//   update  --bucket k--> copy:   bucket k's new params may go up
//   update  -------------> copy:  the next grads down wait for the update
//                                 that reads the host grads
//
// so the update of bucket k+1 runs while bucket k's new params are copied
// up, and the copies hide behind the update. A caller that wants the
// params to stay as they are (the delayed parameter update: step t's update
// runs during step t+1's forward and backward) queues the update without
// the copies and copies the params up at the next step boundary. The host
// waits only in wait(), for everything queued.
//
// Every access is a backend kernel or copy, or declared (the host's read
// of the grads), so the checking backend proves the ordering above. On the
// plain CPU backend "device" and "host" are both host memory, a copy is a
// memcpy on the copy stream's thread and a wait for the compute stream
// returns at once; on CUDA the copies are async copies between pinned host
// memory and the device, and the update stream's kernels, over host
// memory, run on the host in the stream's order.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "zerocore/backend/backend.h"
#include "zerocore/kernels/flat_run.h"
#include "zerocore/kernels/optim.h"
#include "zerocore/tensor.h"

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
  // Throws InvalidArgument when a copy's two sides differ in dtype or size,
  // TypeMismatch naming the tensor when what the host reads or writes (the
  // runs, the spare grads, the grads' destinations, the params' sources) is
  // not host memory. `backend` must outlive the optimizer. The first form
  // makes the two streams on it ("offload copy", "offload update"); the
  // second runs on the caller's (a backend's streams live as long as it
  // does, so a process making many optimizers passes the same two).
  OffloadOptimizer(std::vector<OffloadBucket> buckets, Backend& backend);
  OffloadOptimizer(std::vector<OffloadBucket> buckets, Backend& backend, Stream& copy, Stream& update);
  ~OffloadOptimizer();  // waits for the work in flight
  OffloadOptimizer(const OffloadOptimizer&) = delete;
  OffloadOptimizer& operator=(const OffloadOptimizer&) = delete;

  // Queues every bucket's grads_down on the copy stream, behind the compute
  // stream (what wrote them) and the updates queued before (which read the
  // host grads).
  void copy_grads();
  // Queues the update of every bucket, in order, on the update stream:
  // bucket k's behind the compute stream and its grads_down queued before;
  // with copy_params, each bucket's params_up follows its update on the copy
  // stream. skip_if (host memory, or none): the update leaves everything as
  // it is while that one fp32 element is not zero when the update stream
  // reaches it (a step refused on the device, step/device_verdict.h). The
  // options are checked here, before anything is queued (InvalidArgument).
  void adam(const std::vector<AdamOptions>& groups, int64_t step, double grad_scale, bool copy_params,
            const Tensor& skip_if = Tensor());
  void sgd(const std::vector<SgdOptions>& groups, int64_t step, double grad_scale, bool copy_params,
           const Tensor& skip_if = Tensor());
  // Queues every bucket's params_up, behind the updates queued before and
  // the compute stream (which read the params until now).
  void copy_params();
  // The compute stream goes on after everything queued so far: what it
  // runs next reads the params the copies write, and the next backward
  // writes the host grads the update reads. A stream wait: the host goes on.
  void hand_to_compute();
  // The update stream, ordered behind the grads the next update reads (the
  // compute stream's work so far and every grads_down queued): where work
  // over the host grads goes before the update (its sum of squares, the
  // finiteness verdict), so that the host never waits to read them.
  Stream& after_grads();
  Stream& update_stream() const { return update_; }
  Backend& backend() const { return backend_; }
  // Returns once everything queued has run; rethrows the first error.
  // After an error every later call fails with it too.
  void wait();
  bool busy() const;  // work queued and not yet complete
  // Each run's grad and its spare trade places: the grads the last
  // backward reduced into the spares become the ones the next update
  // reads, without a copy, and the old ones are free for the next
  // backward. Work queued before keeps the buffers it was given: the
  // caller orders what next writes the spares behind it (hand_to_compute,
  // or the params' copy up that the next forward waits for). Every bucket
  // must have spares (InvalidArgument).
  void swap_grads();

  // Every run's host grad (after swap_grads: the ones the next update reads).
  const std::vector<Tensor>& grads() const { return grads_; }
  // The sum of squares of the runs' host grads, in fp64: a host read
  // (after wait(); the checking backend names a read that did not wait).
  double grad_sum_of_squares() const;

 private:
  template <class Options, class Update>
  void update(const std::vector<Options>& groups, bool copy_params, Update update_bucket);
  // Queues `copies` on the copy stream.
  void copy_all(const std::vector<TensorCopy>& copies);
  // `stream` goes on after everything `after` was given so far.
  void order(Stream& stream, Stream& after);

  std::vector<OffloadBucket> buckets_;
  std::vector<Tensor> grads_;  // every run's host grad
  Backend& backend_;
  Stream& copy_;
  Stream& update_;
  // Per bucket, the event of its grads_down queued last (none: nothing
  // copied down since the last update read them).
  std::vector<std::shared_ptr<StreamEvent>> grads_down_;
  // The events behind the last update and the last copy queued since
  // wait() (the next grads down and params up wait for the update).
  std::shared_ptr<StreamEvent> last_update_;
  std::shared_ptr<StreamEvent> last_copy_;
};

}  // namespace zerocore
