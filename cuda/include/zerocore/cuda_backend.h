// The CUDA backend of the seam (backend/backend.h), for one device.
//
// - Memory: device buffers are cudaMalloc, pinned host buffers
//   cudaHostAlloc, pageable ones the host's; each is one allocation made at
//   plan size, never one a step. When pinning fails the buffer is pageable
//   (its kind says so) and the process warns once on stderr: copies to and
//   from it are then synchronous, not wrong.
// - Streams: the compute stream is the caller's (torch's current stream,
//   given as a cudaStream_t handle and settable, since torch's current
//   stream can change between calls; nullptr is the legacy default stream;
//   a change makes the new stream wait for the old one's work on the
//   device);
//   create_stream makes non-blocking streams of the backend's own (comm,
//   copy), destroyed with it.
// - Events: cudaEvent_t without timing; wait is cudaStreamWaitEvent (the
//   host goes on), host_wait cudaEventSynchronize, query cudaEventQuery.
//   record_done: see below.
// - Work: copy is cudaMemcpyAsync between any kinds (host to host: a
//   memcpy in a host function, which keeps the stream's order); fill, accumulate, the
//   sum of squares (into a mailbox) and the optimizer updates over device
//   memory are the CUDA kernels, which instantiate kernels/element_math.h
//   as the CPU ones do; over host memory (the offloaded step) they are the
//   CPU kernels in a host function, in the stream's order; over both, an
//   InvalidArgument (kernel_on_host, backend.h);
//   enqueue runs its body on the calling thread, in program order: host
//   code that issues device work on the stream (an NCCL collective).
//   declare_access does nothing; poison does nothing by default, and with
//   options.poison_released (a debug option: a write of every released
//   slot on the hot path) fills the range with NaN (all bytes 0xFF, a NaN
//   in fp32, bf16 and fp16) in the stream's order.
//
// Every entry checks what it is given before touching CUDA: the stream and
// event are this backend's, every tensor is on its device (or on the host,
// where the op takes host memory), else InvalidArgument naming the op and
// the tensor. Every entry that calls CUDA first makes the backend's device
// current on the calling thread (and restores the caller's on return), so
// any native thread may drive it. A failed CUDA call raises naming the call
// and CUDA's error (cuda/src/cuda_check.h). Nothing here synchronises the
// device; the host blocks only in host_wait (the step's one wait, for the
// mailbox), in a stream wait for a host-completed event (record_done), in
// copies to or from pageable memory (CUDA stages them synchronously; from
// pageable memory the host first waits for the stream, since CUDA reads the
// source when the copy is issued), in
// allocating a zeroed device buffer (once, at plan size) and in a buffer's
// release (cudaFree synchronises, so memory is never freed under work still
// using it). Making the backend touches no CUDA: a bad device index is
// reported by the first call that does.
//
// Memory the caller gives (tensors not from allocate) must stay alive until
// an event recorded after the work using it has completed, as with any
// asynchronous CUDA work; the backend keeps no references.
//
// Its GPU tests are cuda/tests/test_cuda_backend.cpp (run by tests/gpu.sh);
// docs/status.md says what has run on a GPU.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "zerocore/backend/backend.h"
#include "zerocore/backend/owned_streams.h"

namespace zerocore {

struct CudaBackendOptions {
  // Pins `bytes` of host memory, setting *ptr; returns 0 (cudaSuccess) or
  // the cudaError_t of the failure. nullptr: cudaHostAlloc. A test puts a
  // failing one here to play the pageable fallback.
  int (*pin_host)(void** ptr, size_t bytes) = nullptr;
  // poison writes NaN over each released slot and staging range, so that
  // a read of one after its release shows; off by default, since it is a
  // memset per release on the hot path (the engine turns it on for
  // ZEROCORE_CUDA_POISON=1; tests/gpu.sh runs the GPU tests so).
  bool poison_released = false;
};

class CudaBackend : public Backend {
 public:
  // A backend on CUDA device `device`, its compute stream `compute_stream`
  // (a cudaStream_t; its device is checked by set_compute_stream only, as
  // making the backend touches no CUDA).
  explicit CudaBackend(int device, void* compute_stream = nullptr, CudaBackendOptions options = {});
  ~CudaBackend() override;  // destroys its own streams (their work still runs)

  int device() const { return device_; }
  const CudaBackendOptions& options() const { return options_; }
  // The cudaStream_t the compute stream stands for from now on (torch's
  // current stream at the call). Work already enqueued stays where it was,
  // and the new stream waits (on the device, the host goes on) for the work
  // the old one was given before the call, so a change keeps the compute
  // stream's order; the same stream again changes nothing. Call it where no
  // other thread issues work on the compute stream (the engine: at the
  // start of a forward). Throws InvalidArgument for a stream of another
  // device.
  void set_compute_stream(void* handle);
  // The cudaStream_t of one of this backend's streams.
  void* handle(const Stream& stream) const;

  std::shared_ptr<Buffer> allocate(MemoryKind kind, size_t bytes, const std::string& name,
                                   bool zeroed = false) override;
  Stream& compute_stream() override;
  using Backend::create_stream;
  Stream& create_stream(const std::string& name, StreamPlane plane) override;

  std::shared_ptr<StreamEvent> record(Stream& stream) override;
  void wait(Stream& stream, const StreamEvent& event) override;
  void host_wait(const StreamEvent& event) override;
  bool query(const StreamEvent& event) override;
  // A collective issued on the stream (NCCL, by the comm queue's issuing
  // thread: the torch.distributed transport issues inside the comm stream
  // and has that stream wait for NCCL's) is work on the stream: its event
  // is the stream's record, taken by the thread that sets `done`, when it
  // sets it (Event::on_set; the queue sets it once the collective is
  // issued, before it issues the next), so it covers that collective and
  // nothing issued after it. Until then the event is pending: query says
  // not complete, host_wait waits for `done` first (raising its error), and
  // a stream wait blocks the host until `done` is set (until the
  // collective is issued, not done). A collective completed on the host (a
  // CPU transport's: gloo's control plane, `done` set when its data has
  // moved) therefore costs a host block where a stream waits for it.
  std::shared_ptr<StreamEvent> record_done(Stream& stream, std::shared_ptr<Event> done) override;
  std::shared_ptr<Event> host_tail(Stream&) override { return nullptr; }  // NCCL queues on the stream

  // Between any kinds: device tensors on this device, host tensors anywhere.
  void copy(Stream& stream, const Tensor& dst, const Tensor& src) override;
  // Device tensors of this device only.
  void fill(Stream& stream, const Tensor& dst, float value) override;
  void accumulate(Stream& stream, const Tensor& dst, const Tensor& src) override;
  void accumulate_on_grid(Stream& stream, const Tensor& dst, const Tensor& src, int exponent,
                          const Tensor& largest) override;
  // xs on this device; the kernel writes the box (cuda_reduce.h).
  void sum_of_squares(Stream& stream, const std::vector<Tensor>& xs, Mailbox& box, int sum_slot,
                      int finite_slot) override;
  void count_nonfinite(Stream& stream, const std::vector<Tensor>& xs, const Tensor& counter) override;
  void adam_update_runs(Stream& stream, const std::vector<AdamOptions>& groups, int64_t step, double grad_scale,
                        const std::vector<FlatRun>& runs, const Tensor& skip_if) override;
  void sgd_update_runs(Stream& stream, const std::vector<SgdOptions>& groups, int64_t step, double grad_scale,
                       const std::vector<FlatRun>& runs, const Tensor& skip_if) override;
  bool compute_runs_inline() const override { return false; }
  void enqueue(Stream& stream, const std::string& op, const std::vector<Access>& accesses,
               std::function<void()> body) override;

  void declare_access(Stream& stream, const Access& access, const std::string& op) override;
  void declare_host_access(const Access& access, const std::string& op) override;
  // With options.poison_released: device ranges by cudaMemsetAsync, host
  // ranges by a host function in the stream's order; else nothing (the
  // range is checked all the same).
  void poison(Stream& stream, const Tensor& range) override;

 private:
  struct CudaStream;
  CudaStream& cuda_stream(const Stream& stream) const;  // InvalidArgument for another backend's
  // Throws InvalidArgument unless `t` is on this backend's device (or, with
  // `host_ok`, on the host): "<op>: <what> is on cpu, not cuda:N".
  void check_device(const char* op, const char* what, const Tensor& t, bool host_ok) const;
  // Whether a kernel over `operands` runs on the host (all host memory) or
  // on this device (all its memory); kernel_on_host's error otherwise.
  bool runs_on_host(const std::string& op, const KernelOperands& operands) const;
  // The kernels' one dispatch: on_host() as a host function in `stream`'s
  // order where runs_on_host, else on_device(the stream's cudaStream_t).
  // Used (and defined) in cuda_backend.cpp only.
  template <typename OnHost, typename OnDevice>
  void dispatch(Stream& stream, const std::string& op, const KernelOperands& operands, OnHost on_host,
                OnDevice on_device);

  const int device_;
  const CudaBackendOptions options_;
  OwnedStreams<CudaStream> streams_;
  CudaStream* compute_;  // the first of streams_, read without their lock
};

}  // namespace zerocore
