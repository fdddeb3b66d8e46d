// Whether a step's grads were finite, decided on the device, so that a
// step where the host needs no number (no dynamic loss scaling, no
// clipping, no host update) never waits for the device: the host enqueues
// the next forward while the device is still on this backward.
//
// A flag in device memory counts the non-finite partitions (count(), on
// the compute stream; ZeroStep sums it over ranks on the data queue). The
// update kernels skip while it is not zero, so a refused step changes
// nothing, and neither does any step after it until the host has answered
// it (clear()): the flag is sticky. Once each step is decided the flag is
// copied to a small ring of pinned host slots; the host reads them when
// they are there (a query, no wait) and learns which step was refused
// first. Reading that is not in step with the other ranks (a GPU's lead
// differs), so the step's exchange carries what each rank read and ranks
// act on it together (zero_step.cpp).
//
// With ZeRO-Offload the grads and the update are the host's, on the
// offloaded update's stream: the count goes there, into pinned memory
// (sticky there), crosses to the device flag for the ranks' sum, and comes
// back to pinned memory for the update's kernels (skip_if()), all in the
// streams' order, so the training thread waits for none of it.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>

#include "zerocore/backend/backend.h"

namespace zerocore {

class DeviceVerdict {
 public:
  // `backend` must outlive it, and `host_stream` (the offloaded update's
  // stream, whose grads are host memory; nullptr: the grads are the
  // compute stream's, in device memory). Allocates the flag (device
  // memory, zeroed), the ring of readbacks and, with a host stream, the
  // flag's two host copies (pinned host memory) once.
  DeviceVerdict(Backend& backend, Stream* host_stream);

  // Where the verdict is counted, read by the update and noted.
  Stream& stream() const { return host_stream_ ? *host_stream_ : backend_.compute_stream(); }
  // The flag: one fp32 element, 0 while every step since the last clear()
  // had finite grads (with a host stream: this step's copy of the host's
  // count). The ranks' all-reduce sums it, behind stream().
  const Tensor& flag() const { return flag_; }
  // On stream(): the count += 1 when some element of `grads` is not finite.
  void count(const std::vector<Tensor>& grads);
  // What the update kernels read as their skip_if, behind the ranks' sum:
  // the flag, or with a host stream its copy back to the host, queued now.
  const Tensor& skip_if();
  // Step `step` is decided (on stream(), behind the ranks' sum): the flag
  // goes to the host; the compute stream waits for it, so a host that runs
  // the compute stream inline (the CPU backends) reads it at once. With
  // every slot of the ring unread, the host first waits for the oldest (a
  // device kRing steps behind the host).
  void note(int64_t step);
  // The readbacks that are there (all of them, waiting for each, with
  // `wait`), in step order: the first step the device refused, or 0.
  int64_t read(bool wait);
  // The refused steps are answered: the count is 0 again, in stream()'s
  // order, and the readbacks not read yet are dropped (they would
  // only say the same).
  void clear();

  size_t device_bytes() const { return flag_.nbytes(); }  // its own memory, by kind
  size_t host_bytes() const { return ring_.nbytes() + host_count_.nbytes() + host_skip_.nbytes(); }

  static constexpr int kRing = 4;

 private:
  struct Readback {
    int64_t step;
    int slot;
    std::shared_ptr<StreamEvent> done;
  };
  int64_t read_front(bool wait);  // the oldest readback, -1 if it is not there yet

  Backend& backend_;
  Stream* host_stream_;
  Tensor flag_;
  Tensor ring_;  // kRing fp32 slots of pinned host memory
  // With a host stream, in pinned memory: the sticky count of the host's
  // grads, and the ranks' sum as the update's kernels read it.
  Tensor host_count_;
  Tensor host_skip_;
  std::deque<Readback> pending_;
  int next_slot_ = 0;
};

}  // namespace zerocore
