// The checking CPU backend: the plain CPU backend made to prove the
// runtime's ordering without a GPU (docs/runtime.md, "The backend seam").
// - Every stream is its own thread (the compute stream: the caller) with a
//   vector clock; recording an event captures the clock, waiting for one
//   joins it. The host has a clock of its own, separate from the compute
//   stream's (on CUDA the compute stream is the device's): only a host wait
//   joins it, and every stream given work joins it.
// - Every access to a backend buffer (kernels, copies, enqueued work such
//   as collectives, and what the host declares with declare_access) is
//   checked against the buffer's last conflicting accesses from other
//   streams; a pair no chain of events orders is a violation that names
//   both accesses and the buffer (StreamOrderError).
// - Work on a non-compute stream starts after a seeded random delay, so a
//   missing wait also reads stale data; buffers allocated without `zeroed`
//   and poisoned ranges read as NaN.
// - Blocking host waits are counted, and apart those that wait for device
//   work (a device-plane stream's: StreamPlane), which on CUDA stall the
//   host behind the GPU (the target is none outside the step's decision).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "zerocore/backend/cpu_backend.h"
#include "zerocore/error.h"  // StreamOrderError

namespace zerocore {

class OrderChecker;

struct CheckingOptions {
  uint64_t seed = 0;  // of the delays
  // Each piece of work on a non-compute stream starts after a delay drawn
  // uniformly from [min_delay_us, max_delay_us] microseconds.
  int64_t min_delay_us = 0;
  int64_t max_delay_us = 200;
  // Raise at the violating call; otherwise only count it (see check()).
  bool throw_on_violation = true;
  // What compute_runs_inline() says: false makes the engine treat the
  // compute stream as a GPU's (the step reads its device verdicts when a
  // later exchange comes), though it still runs on the calling thread.
  bool compute_inline = true;
};

class CheckingCpuBackend : public CpuBackend {
 public:
  explicit CheckingCpuBackend(CheckingOptions options = {});
  ~CheckingCpuBackend() override;

  std::shared_ptr<Buffer> allocate(MemoryKind kind, size_t bytes, const std::string& name,
                                   bool zeroed = false) override;
  using Backend::create_stream;
  Stream& create_stream(const std::string& name, StreamPlane plane) override;

  std::shared_ptr<StreamEvent> record(Stream& stream) override;
  void wait(Stream& stream, const StreamEvent& event) override;
  void host_wait(const StreamEvent& event) override;
  bool compute_runs_inline() const override { return options_.compute_inline; }
  bool query(const StreamEvent& event) override;
  std::shared_ptr<StreamEvent> record_done(Stream& stream, std::shared_ptr<Event> done) override;

  void enqueue(Stream& stream, const std::string& op, const std::vector<Access>& accesses,
               std::function<void()> body) override;
  void declare_access(Stream& stream, const Access& access, const std::string& op) override;
  void declare_host_access(const Access& access, const std::string& op) override;
  void poison(Stream& stream, const Tensor& range) override;

  // The violations found so far, each naming both accesses and the buffer.
  std::vector<std::string> violations() const;
  // Throws StreamOrderError with the first violation (and the count) if any.
  void check() const;

  // Blocking host waits (host_wait) since the last take_host_waits(), which
  // resets the count: call it once a step. Stream waits do not block the
  // host on CUDA and are not counted.
  int64_t host_waits() const { return host_waits_.load(); }
  int64_t take_host_waits() { return host_waits_.exchange(0); }
  // Of those, the ones that waited for device work: for work of a
  // device-plane stream (compute, a data queue's, a copy stream) that the
  // host was not yet ordered after, directly or through a control-plane
  // stream that waited for it. A wait for a control-plane collective alone
  // (a round's flags) is not one. Since the last take_device_waits().
  int64_t device_waits() const { return device_waits_.load(); }
  int64_t take_device_waits() { return device_waits_.exchange(0); }
  // The host's lead over the device, by the clocks: (operations enqueued on
  // device-plane streams, of those the ones the host is ordered after: it
  // saw them done, by a wait or a query). Between two calls, work enqueued
  // while the second number stays put ran ahead of the host's knowledge: on
  // a GPU the host got that far before the device finished any of it.
  std::pair<uint64_t, uint64_t> device_work();
  // (operations enqueued on `of`, of them the ones `stream` is ordered
  // after): whether work on `stream` could have waited behind `of`'s.
  std::pair<uint64_t, uint64_t> ordered_after(const Stream& stream, const Stream& of);
  // allocate() calls for device memory so far: steady-state training makes
  // none (on CUDA each would be a cudaMalloc, a host synchronisation).
  int64_t device_allocations() const { return device_allocations_.load(); }

 private:
  void checked(Stream& stream, const std::string& op, const std::vector<Access>& accesses);
  // A kernel's tensors are all host or all device memory, as the CUDA
  // backend needs (kernel_on_host, backend.h): memory of no backend buffer
  // (torch's) is device memory, where training runs.
  void check_kernel_memory(const std::string& op, const KernelOperands& operands) const override;
  void report(const std::vector<std::string>& found);  // records (and raises) what access() found
  // The checker's clock of `stream`: the stream's index + 1 (clock 0 is the host's).
  int clock_index(const Stream& stream) const;

  const CheckingOptions options_;
  const std::shared_ptr<OrderChecker> checker_;
  mutable std::mutex mutex_;  // violations_, delays_ and planes_
  std::vector<std::string> violations_;
  std::vector<std::mt19937_64> delays_;  // one generator per stream, so each stream's delays are reproducible
  std::vector<StreamPlane> planes_;  // by stream index
  std::atomic<int64_t> host_waits_{0};
  std::atomic<int64_t> device_waits_{0};
  std::atomic<int64_t> device_allocations_{0};
};

}  // namespace zerocore
