// Whether a step's grads were finite, decided on the device, so that a
// step where the host needs no number (no dynamic loss scaling, no
// clipping, no host update) never waits for the device: the host enqueues
// the next forward while the device is still on this backward.
//
// A flag in device memory counts the non-finite partitions (count(), on
// the compute stream; ZeroStep sums it over ranks on the data queue). The
// update kernels skip while it is not zero, so a refused step changes
// nothing, and neither does any step after it until the host has answered
// it (clear()): the flag is sticky. Behind each step's update the flag is
// copied to a small ring of pinned host slots; the host reads them when
// they are there (a query, no wait) and learns which step was refused
// first. Reading that is not in step with the other ranks (a GPU's lead
// differs), so the step's exchange carries what each rank read and ranks
// act on it together (zero_step.cpp).
#pragma once
#include <cstdint>
#include <deque>
#include <memory>

#include "zerocore/backend/backend.h"

namespace zerocore {

class DeviceVerdict {
 public:
  // `backend` must outlive it. Allocates the flag (device memory, zeroed)
  // and the ring of readbacks (pinned host memory) once.
  explicit DeviceVerdict(Backend& backend);

  // The flag: one fp32 element, 0 while every step since the last clear()
  // had finite grads. The update's skip_if; the ranks' all-reduce sums it.
  const Tensor& flag() const { return flag_; }
  // On the compute stream: flag += 1 when some element of `grads` is not finite.
  void count(const std::vector<Tensor>& grads);
  // Behind step `step`'s update (on the compute stream): the flag goes to
  // the host. With every slot of the ring unread, the host first waits for
  // the oldest (a device kRing steps behind the host).
  void note(int64_t step);
  // The readbacks that are there (all of them, waiting for each, with
  // `wait`), in step order: the first step the device refused, or 0.
  int64_t read(bool wait);
  // The refused steps are answered: the flag is 0 again, in the compute
  // stream's order, and the readbacks not read yet are dropped (they would
  // only say the same).
  void clear();

  size_t device_bytes() const { return flag_.nbytes(); }  // its own memory, by kind
  size_t host_bytes() const { return ring_.nbytes(); }

  static constexpr int kRing = 4;

 private:
  struct Readback {
    int64_t step;
    int slot;
    std::shared_ptr<StreamEvent> done;
  };
  int64_t read_front(bool wait);  // the oldest readback, -1 if it is not there yet

  Backend& backend_;
  Tensor flag_;
  Tensor ring_;  // kRing fp32 slots of pinned host memory
  std::deque<Readback> pending_;
  int next_slot_ = 0;
};

}  // namespace zerocore
