// ZeRO-Offload's update as the native step (ZeroStep) drives it: the policy
// over an OffloadOptimizer (offload/offload_optimizer.h) that says when the
// host grads are taken, when the update's params go up and when they wait
// for the next step (the delayed update, python/zerocore/state/offload.py). The
// step calls it between its own parts, so the whole step is one native call
// that never calls back into Python.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "zerocore/offload/offload_optimizer.h"
#include "zerocore/step/zero_step.h"

namespace zerocore {

class HostUpdate {
 public:
  // swaps_grads: reduction writes into spare host grads (stages 2-3 with a
  // delayed update) that trade places with the update's at each step,
  // rather than being copied down. delays_from: the first step whose
  // update is delayed (its params go up at the next step boundary); none:
  // never. `optimizer` must outlive this.
  HostUpdate(OffloadOptimizer& optimizer, bool swaps_grads, std::optional<int64_t> delays_from);

  // This step's grads become the update's, without a host wait: swapped
  // in, or queued down behind a pending update (which reads the host
  // grads). Once a step, before the exchange.
  void take_grads();
  // The update stream, ordered behind the grads taken: where work over
  // them goes before the update (their sum of squares, their finiteness).
  Stream& after_grads() { return optimizer_.after_grads(); }
  const std::vector<Tensor>& grads() const { return optimizer_.grads(); }
  Stream& stream() { return optimizer_.update_stream(); }
  Backend& backend() const { return optimizer_.backend(); }
  // The update of an applied step, after a pending update's params went
  // up: overlapped with its params' copies up, or, delayed (or serial),
  // queued with the params left for the next boundary (delayed) or copied
  // up once it is done (serial). skip_if: OffloadOptimizer::adam's. Not
  // delayed, the compute stream then waits for the params up (the next
  // forward reads them); the host never does.
  void apply(const StepOptions& options, double grad_scale, const Tensor& skip_if);
  // A pending update's params go up, the compute stream waiting for them;
  // true when there was one (the caller then gathers them in stages 1-2).
  bool params_up();
  // params_up(), then the host waits for everything queued: it reads the
  // master params or the states next (a checkpoint, the final params).
  bool finish();

  bool pending() const { return pending_; }
  // Serial: the params go up only once the whole update is done (the
  // step-by-step schedule the overlap is measured against: bench/offload_bench.py).
  bool serial = false;
  // Counts since construction: the host grad buffers' swaps (the caller's
  // views of them follow) and the times the params went up (copy volume).
  int64_t grad_swaps() const { return grad_swaps_; }
  int64_t params_sent() const { return params_sent_; }

 private:
  OffloadOptimizer& optimizer_;
  bool swaps_grads_;
  std::optional<int64_t> delays_from_;
  bool pending_ = false;  // an update queued whose params are not up yet
  int64_t grad_swaps_ = 0;
  int64_t params_sent_ = 0;
};

}  // namespace zerocore
