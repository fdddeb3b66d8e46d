#include "zerocore/step/device_verdict.h"

#include <string>

namespace zerocore {

DeviceVerdict::DeviceVerdict(Backend& backend)
    : backend_(backend),
      flag_(backend.allocate(MemoryKind::kDevice, sizeof(float), "the step's device verdict", true)
                ->view(0, DType::kFloat32, {1})),
      ring_(backend.allocate(MemoryKind::kHostPinned, kRing * sizeof(float), "the step verdict's readbacks", true)
                ->view(0, DType::kFloat32, {kRing})) {}

void DeviceVerdict::count(const std::vector<Tensor>& grads) {
  backend_.count_nonfinite(backend_.compute_stream(), grads, flag_);
}

void DeviceVerdict::note(int64_t step) {
  if (pending_.size() == size_t(kRing)) read_front(true);  // the ring's oldest slot is about to be reused
  const int slot = next_slot_;
  next_slot_ = (next_slot_ + 1) % kRing;
  Stream& compute = backend_.compute_stream();
  backend_.copy(compute, ring_.slice(slot, 1), flag_);
  pending_.push_back(Readback{step, slot, backend_.record(compute)});
}

int64_t DeviceVerdict::read_front(bool wait) {
  const Readback& front = pending_.front();
  if (wait) {
    backend_.host_wait(*front.done);
  } else if (!backend_.query(*front.done)) {
    return -1;
  }
  const Tensor slot = ring_.slice(front.slot, 1);
  backend_.declare_host_access(Access::read(slot), "host read of the step verdict's readback");
  const int64_t refused = *slot.data_as<float>() != 0.0f ? front.step : 0;
  pending_.pop_front();
  return refused;
}

int64_t DeviceVerdict::read(bool wait) {
  while (!pending_.empty()) {
    const int64_t refused = read_front(wait);
    if (refused < 0) break;
    if (refused > 0) {
      pending_.clear();  // later readbacks say the same: the flag is sticky
      return refused;
    }
  }
  return 0;
}

void DeviceVerdict::clear() {
  backend_.fill(backend_.compute_stream(), flag_, 0.0f);
  pending_.clear();
}

}  // namespace zerocore
