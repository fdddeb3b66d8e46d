// The backend seam: everything the runtime does to memory goes through a
// Backend, so the same store, schedules and pipelines run on the CPU and on
// CUDA. A backend gives buffers of a memory kind, streams, events between
// them, async copies, the runtime's kernels enqueued on a stream, and host
// work enqueued in stream order (a CPU transport's collectives). Nothing it
// enqueues has happened when the call returns: a stream reads the result
// after waiting for an event recorded behind it, the host after host_wait.
//
// The mapping to CUDA: allocate is cudaMalloc / cudaHostAlloc / malloc;
// a Stream a cudaStream_t (the compute stream torch's current one); record
// cudaEventRecord; wait cudaStreamWaitEvent; host_wait
// cudaEventSynchronize; query cudaEventQuery; copy cudaMemcpyAsync; each
// kernel a launch on the stream; enqueue issues device work (an NCCL
// collective) on the stream from the host.
//
// A backend is driven by one host thread (a rank's). Errors of work on a
// non-compute stream surface where an event behind it is waited for, as
// CUDA's asynchronous errors do.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "zerocore/backend/mailbox.h"
#include "zerocore/backend/memory.h"
#include "zerocore/backend/stream.h"
#include "zerocore/kernels/flat_run.h"
#include "zerocore/kernels/optim.h"
#include "zerocore/tensor.h"

namespace zerocore {

class Event;

class Backend {
 public:
  virtual ~Backend() = default;

  // Memory. `zeroed`: the buffer reads as zeros; otherwise its contents are
  // undefined (NaN under the checking backend).
  virtual std::shared_ptr<Buffer> allocate(MemoryKind kind, size_t bytes, const std::string& name,
                                           bool zeroed = false) = 0;
  // The bytes of the buffers of `kind` this backend allocated that are
  // alive: a buffer counts from allocate until its last view is dropped
  // (on CUDA, until it is freed), whatever outlives the backend.
  size_t allocated_bytes(MemoryKind kind) const;
  // The kind of the live buffer of this backend that `address` lies in;
  // none for memory it did not allocate (a torch tensor's).
  std::optional<MemoryKind> kind_of(const void* address) const;

  // Streams. The compute stream is the caller's; the others are the
  // backend's own, alive as long as it is.
  virtual Stream& compute_stream() = 0;
  virtual Stream& create_stream(const std::string& name, StreamPlane plane) = 0;
  Stream& create_stream(const std::string& name) { return create_stream(name, StreamPlane::kDevice); }

  // Events. record marks everything enqueued on `stream` so far; `stream`
  // waits (without blocking the host) or the host waits (blocking) for all
  // of it; query says, without blocking, whether it has all happened.
  virtual std::shared_ptr<StreamEvent> record(Stream& stream) = 0;
  virtual void wait(Stream& stream, const StreamEvent& event) = 0;
  virtual void host_wait(const StreamEvent& event) = 0;
  virtual bool query(const StreamEvent& event) = 0;
  // The event of work that `stream`'s owner runs itself in the stream's
  // order: a CPU transport's collective, which the comm queue's threads
  // issue and complete. Ordered after everything on `stream` so far, as
  // record's, and complete once `done` is set (its error raised by the
  // waits). On CUDA a collective is work on the stream (NCCL) and its
  // event is record's.
  virtual std::shared_ptr<StreamEvent> record_done(Stream& stream, std::shared_ptr<Event> done) = 0;
  // Where host threads keep a stream's order (the CPU backends): a flag set
  // once everything `stream` was given so far has run, its waits included,
  // or nullptr when it has. A transport that moves the data when it is
  // called (gloo, the in-process group) waits for it before it moves a
  // collective's, so the collective comes after what its stream waits for.
  // Always nullptr where the stream itself holds a transport's work back
  // (CUDA: NCCL's kernels queue on it).
  virtual std::shared_ptr<Event> host_tail(Stream& stream) = 0;

  // Blocking host waits that last: once a host wait (host_wait, and on the
  // CPU a wait of the compute stream, which is the caller) has waited
  // `after_seconds`, it calls `stalled(seconds waited so far)`, and again
  // every after_seconds while it goes on waiting; what `stalled` throws
  // ends the wait (the event's work goes on). The engine's diagnosis of
  // ranks in different collectives (zerocore/positions.py): device work
  // stuck behind a collective its peers never issue is never waited for
  // whole. An empty `stalled` (the default) waits whole. A waiting thread
  // uses the watch set when its wait began.
  void watch_host_waits(double after_seconds, std::function<void(double)> stalled);

  // Work on `stream`, named in the checker's reports by what it is.
  // dst = src, byte for byte (same dtype and size), between any memory kinds.
  virtual void copy(Stream& stream, const Tensor& dst, const Tensor& src) = 0;
  // Every element of dst = value (rounded to dst's dtype).
  virtual void fill(Stream& stream, const Tensor& dst, float value) = 0;
  // dst += src, computed in fp32 and rounded once to dst's dtype.
  virtual void accumulate(Stream& stream, const Tensor& dst, const Tensor& src) = 0;
  // dst (int64) += src * 2**-exponent rounded to an integer, ties to even,
  // and largest (one fp32 element, where src is) = the largest of itself
  // and every |src| (a NaN or an inf stays): Config(deterministic=True)'s
  // grads onto their grid and into the int64 staging, one pass, their
  // largest kept for the step to read once, with no host wait a grad
  // (kernels/cpu_exact_grid.h).
  virtual void accumulate_on_grid(Stream& stream, const Tensor& dst, const Tensor& src, int exponent,
                                  const Tensor& largest) = 0;
  // box[sum_slot] = the sum of squares of every element of xs (fp64);
  // box[finite_slot] = 1 when every element is finite, else 0.
  virtual void sum_of_squares(Stream& stream, const std::vector<Tensor>& xs, Mailbox& box, int sum_slot,
                              int finite_slot) = 0;
  // counter (one fp32 element, on the side of xs) += 1 when some element
  // of xs is not finite: the step's verdict, decided on the device
  // (step/device_verdict.h).
  virtual void count_nonfinite(Stream& stream, const std::vector<Tensor>& xs, const Tensor& counter) = 0;
  // One optimizer step over every run of a partition (cpu_optim.h's
  // adam_update_runs and sgd_update_runs on the CPU). skip_if: none (an
  // empty Tensor), or one fp32 element the kernel reads when it runs: not
  // zero, it updates nothing (a step refused on the device, without the
  // host reading the verdict first).
  virtual void adam_update_runs(Stream& stream, const std::vector<AdamOptions>& groups, int64_t step,
                                double grad_scale, const std::vector<FlatRun>& runs, const Tensor& skip_if) = 0;
  virtual void sgd_update_runs(Stream& stream, const std::vector<SgdOptions>& groups, int64_t step,
                               double grad_scale, const std::vector<FlatRun>& runs, const Tensor& skip_if) = 0;
  // Whether work on the compute stream has happened when its call returns
  // (the CPU backends: the caller's thread runs it), so a query of an event
  // behind it is true on every rank alike.
  virtual bool compute_runs_inline() const = 0;
  // `body` in stream order, touching exactly `accesses` (a collective),
  // reported as `op`.
  virtual void enqueue(Stream& stream, const std::string& op, const std::vector<Access>& accesses,
                       std::function<void()> body) = 0;

  // What only the checking backend acts on; the others do nothing.
  // `stream` uses `access` directly, for example autograd reading a
  // gathered unit's params on the compute stream.
  virtual void declare_access(Stream& stream, const Access& access, const std::string& op) = 0;
  // The host itself (not work on a stream) uses `access`, for example a
  // read of a mailbox slot or of the offloaded grads: ordered after a
  // stream's work only by a host wait for it (host_wait, or a query that
  // returned true), as on CUDA.
  virtual void declare_host_access(const Access& access, const std::string& op) = 0;
  // A released slot or staging buffer: overwritten with NaN in `stream`'s
  // order (the stream of its last use), so a stale read shows. The checking
  // backend does, the CUDA one when asked (CudaBackendOptions::
  // poison_released, a debug option); the plain CPU one does nothing.
  virtual void poison(Stream& stream, const Tensor& range) = 0;

 protected:
  Backend();
  // A host wait under the watch (watch_host_waits): wait_for(seconds)
  // waits at most that long (a negative number: whole) and says whether
  // the event completed.
  void watched_wait(const std::function<bool(double)>& wait_for) const;
  // What every allocate returns: a Buffer over `storage` (which owns the
  // memory at `data`), counted in allocated_bytes until it is freed.
  std::shared_ptr<Buffer> counted_buffer(MemoryKind kind, Device device, const std::string& name, void* data,
                                         size_t bytes, std::shared_ptr<void> storage);

 private:
  struct LiveBytes;  // shared with the buffers' storage: a buffer may outlive its backend
  std::shared_ptr<LiveBytes> live_;
  struct Watch;  // watch_host_waits' (shared: a wait keeps the watch it began with)
  std::shared_ptr<const Watch> watch_;
  mutable std::mutex watch_mutex_;
};

// The accesses of one optimizer step over `runs` (params, state and copies
// written, grads and skip_if, if given, read): what every backend's update
// declares.
std::vector<Access> update_accesses(const std::vector<FlatRun>& runs, const Tensor& skip_if);

// Kernels run where their memory is: with every tensor in host memory, on
// the host in the stream's order (the offload optimizer's update, the add
// of reduced grads into an offloaded partition); with every tensor in
// device memory, on the device. A kernel given both (a device kernel
// cannot write pageable host memory, and one over pinned memory would
// cross the bus element by element) is an InvalidArgument naming them:
// copy across first. Each operand is (what it is, whether it is host
// memory); returns whether the kernel runs on the host. The mailbox a
// reduction writes is not an operand: it is pinned host memory a device
// kernel writes once.
bool kernel_on_host(const std::string& op, const std::vector<std::pair<std::string, bool>>& operands);
// A kernel's tensors, each with what it is ("dst", "run 0's grad").
using KernelOperands = std::vector<std::pair<std::string, const Tensor*>>;
// The operands of an update over `runs`, and of a sum of squares of `xs`.
KernelOperands update_operands(const std::vector<FlatRun>& runs, const Tensor& skip_if);
KernelOperands sum_operands(const std::vector<Tensor>& xs);

}  // namespace zerocore
