#include "zerocore/step/device_verdict.h"

#include <string>

namespace zerocore {

namespace {

Tensor floats(Backend& backend, MemoryKind kind, int64_t count, const std::string& name) {
  return backend.allocate(kind, size_t(count) * sizeof(float), name, true)->view(0, DType::kFloat32, {count});
}

}  // namespace

DeviceVerdict::DeviceVerdict(Backend& backend, Stream* host_stream)
    : backend_(backend),
      host_stream_(host_stream),
      flag_(floats(backend, MemoryKind::kDevice, 1, "the step's device verdict")),
      ring_(floats(backend, MemoryKind::kHostPinned, kRing, "the step verdict's readbacks")) {
  if (host_stream_ != nullptr) {
    const Tensor both = floats(backend, MemoryKind::kHostPinned, 2, "the step verdict's host copies");
    host_count_ = both.slice(0, 1);
    host_skip_ = both.slice(1, 1);
  }
}

void DeviceVerdict::count(const std::vector<Tensor>& grads) {
  if (host_stream_ == nullptr) {
    backend_.count_nonfinite(backend_.compute_stream(), grads, flag_);
    return;
  }
  // The host's count is the sticky one: the device flag, which the ranks'
  // sum overwrites, starts from it each step.
  backend_.count_nonfinite(*host_stream_, grads, host_count_);
  backend_.copy(*host_stream_, flag_, host_count_);
}

const Tensor& DeviceVerdict::skip_if() {
  if (host_stream_ == nullptr) return flag_;
  backend_.copy(*host_stream_, host_skip_, flag_);
  return host_skip_;
}

void DeviceVerdict::note(int64_t step) {
  if (pending_.size() == size_t(kRing)) read_front(true);  // the ring's oldest slot is about to be reused
  const int slot = next_slot_;
  next_slot_ = (next_slot_ + 1) % kRing;
  backend_.copy(stream(), ring_.slice(slot, 1), flag_);
  pending_.push_back(Readback{step, slot, backend_.record(stream())});
  if (host_stream_ != nullptr) backend_.wait(backend_.compute_stream(), *pending_.back().done);
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
  backend_.fill(stream(), host_stream_ ? host_count_ : flag_, 0.0f);
  pending_.clear();
}

}  // namespace zerocore
