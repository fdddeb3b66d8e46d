#include "zerocore/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "cuda_check.h"
#include "zerocore/cuda_elementwise.h"
#include "zerocore/cuda_optim.h"
#include "zerocore/cuda_reduce.h"
#include "zerocore/error.h"
#include "zerocore/kernels/cpu_accumulate.h"
#include "zerocore/kernels/cpu_exact_grid.h"
#include "zerocore/kernels/cpu_fill.h"
#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/kernels/cpu_reduce.h"
#include "zerocore/kernels/optim_args.h"
#include "zerocore/runtime/arena.h"
#include "zerocore/runtime/event.h"

namespace zerocore {

using cuda_detail::check;
using cuda_detail::DeviceGuard;

struct CudaBackend::CudaStream : Stream {
  CudaStream(std::string name, int index, StreamPlane plane, cudaStream_t handle)
      : Stream(std::move(name), plane), index(index), handle(handle) {}
  const int index;
  // The compute stream's changes with the caller's current stream.
  std::atomic<cudaStream_t> handle;
};

namespace {

constexpr int kCompute = 0;
// The longest pause between two polls of a watched host wait (CudaBackend::host_wait).
constexpr std::chrono::microseconds kLongestPollPause{500};

std::string where(const Tensor& t) {
  return t.device().type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(t.device().index);
}

// What a CudaBackend records. An event of record_done is pending until its
// `done` is set; it is recorded on its stream then, by the thread that sets
// `done` (Event::on_set) or by a wait or query that gets there first.
class CudaEvent : public StreamEvent {
 public:
  CudaEvent(const CudaBackend* owner, cudaStream_t stream, std::shared_ptr<Event> done)
      : owner_(owner), stream_(stream), done_(std::move(done)) {
    DeviceGuard guard(owner->device());
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    if (!done_) record();
  }
  ~CudaEvent() override { (void)cudaEventDestroy(event_); }

  const CudaBackend* owner() const { return owner_; }
  bool pending() const { return done_ && !done_->ready(); }
  // The CUDA event, once not pending (recording it if no one did yet).
  cudaEvent_t recorded() const {
    if (done_) std::call_once(recorded_, [this] { record(); });
    return event_;
  }
  // Blocks until `done` is set (raising the error it carries), then the
  // CUDA event: what every wait needs.
  cudaEvent_t resolved() const {
    if (done_) done_->wait();
    return recorded();
  }

 private:
  void record() const {
    DeviceGuard guard(owner_->device());
    check(cudaEventRecord(event_, stream_), "cudaEventRecord");
  }

  const CudaBackend* owner_;
  cudaStream_t stream_;
  std::shared_ptr<Event> done_;
  cudaEvent_t event_ = nullptr;
  mutable std::once_flag recorded_;
};

int pin_with_cuda(void** ptr, size_t bytes) { return int(cudaHostAlloc(ptr, bytes, cudaHostAllocPortable)); }

void warn_pageable_once(const std::string& name, size_t bytes, cudaError_t err) {
  static std::once_flag warned;
  std::call_once(warned, [&] {
    std::fprintf(stderr,
                 "zerocore: warning: could not pin %zu bytes of host memory for '%s' (%s: %s); using pageable "
                 "memory instead, whose copies to and from the device are synchronous (warned once a process)\n",
                 bytes, name.c_str(), cudaGetErrorName(err), cudaGetErrorString(err));
  });
}

// Frees on `device` from a destructor: it must not throw, and a failure to
// free is not worth losing the caller's state over.
template <class Free>
void release_on(int device, Free free) {
  try {
    DeviceGuard guard(device);
    (void)free();
  } catch (...) {
  }
}

// Host work in a stream's order: a host function (which may make no CUDA
// call) runs it once the stream's work before it is done.
void CUDART_CB run_host_work(void* arg) {
  std::unique_ptr<std::function<void()>> work(static_cast<std::function<void()>*>(arg));
  (*work)();
}

// Host memory CUDA did not pin (cudaHostAlloc or cudaHostRegister).
bool pageable(const void* host) {
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, host), "cudaPointerGetAttributes");
  return attributes.type == cudaMemoryTypeUnregistered;
}

void launch_host_work(cudaStream_t stream, std::function<void()> work, const char* what) {
  auto arg = std::make_unique<std::function<void()>>(std::move(work));
  check(cudaLaunchHostFunc(stream, run_host_work, arg.get()), what);
  arg.release();  // run_host_work owns it now
}

}  // namespace

CudaBackend::CudaBackend(int device, void* compute_stream, CudaBackendOptions options)
    : device_(device), options_(options) {
  if (device < 0) throw InvalidArgument("CudaBackend: device index " + std::to_string(device) + " is negative");
  compute_ = &streams_.add("compute", StreamPlane::kDevice, static_cast<cudaStream_t>(compute_stream));
}

CudaBackend::~CudaBackend() {
  streams_.each([this](const CudaStream& s) {
    if (s.index == kCompute) return;  // the caller's
    const cudaStream_t h = s.handle.load();
    release_on(device_, [h] { return cudaStreamDestroy(h); });
  });
}

void CudaBackend::set_compute_stream(void* handle) {
  const auto h = static_cast<cudaStream_t>(handle);
  const cudaStream_t old = compute_->handle.load();
  if (h == old) return;  // nothing to order, and no CUDA touched
  DeviceGuard guard(device_);
  if (h) {  // a stream of another device would fail later, far from its cause
    int device = -1;
    check(cudaStreamGetDevice(h, &device), "cudaStreamGetDevice(compute stream)");
    if (device != device_) {
      throw InvalidArgument("set_compute_stream: the stream is on cuda:" + std::to_string(device) +
                            ", not cuda:" + std::to_string(device_) + " (this backend's device)");
    }
  }
  // The new stream waits, on the device, for what the old one was given so
  // far (the runtime's work and the caller's), so nothing issued on the new
  // stream overtakes it: the compute stream's work keeps its order.
  cudaEvent_t switched = nullptr;
  check(cudaEventCreateWithFlags(&switched, cudaEventDisableTiming), "cudaEventCreateWithFlags(stream switch)");
  const std::unique_ptr<CUevent_st, cudaError_t (*)(cudaEvent_t)> owned(switched, cudaEventDestroy);
  check(cudaEventRecord(switched, old), "cudaEventRecord(old compute stream)");
  check(cudaStreamWaitEvent(h, switched, 0), "cudaStreamWaitEvent(new compute stream)");
  compute_->handle = h;
}

void* CudaBackend::handle(const Stream& stream) const { return cuda_stream(stream).handle.load(); }

std::shared_ptr<Buffer> CudaBackend::allocate(MemoryKind kind, size_t bytes, const std::string& name, bool zeroed) {
  const int device = device_;
  if (kind == MemoryKind::kDevice) {
    DeviceGuard guard(device);
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), ("cudaMalloc(" + std::to_string(bytes) + " bytes for '" + name + "')").c_str());
    std::shared_ptr<void> storage(p, [device](void* q) { release_on(device, [q] { return cudaFree(q); }); });
    if (zeroed) {
      // At plan time, once: the host waits, so the zeros are there for
      // whichever stream uses the buffer first.
      check(cudaMemset(p, 0, bytes), "cudaMemset");
      check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize(after zeroing)");
    }
    return counted_buffer(kind, Device{DeviceType::kCUDA, device}, name, p, bytes, std::move(storage));
  }
  if (kind == MemoryKind::kHostPinned) {
    DeviceGuard guard(device);
    void* p = nullptr;
    const auto err = cudaError_t((options_.pin_host ? options_.pin_host : pin_with_cuda)(&p, bytes));
    if (err == cudaSuccess) {
      std::shared_ptr<void> storage(p, [device](void* q) { release_on(device, [q] { return cudaFreeHost(q); }); });
      if (zeroed) std::memset(p, 0, bytes);
      return counted_buffer(kind, Device{}, name, p, bytes, std::move(storage));
    }
    (void)cudaGetLastError();  // a failed allocation is not sticky; clear it
    warn_pageable_once(name, bytes, err);
  }
  auto arena = HostArena::create(bytes, zeroed);
  return counted_buffer(MemoryKind::kHostPageable, Device{}, name, arena->data(), bytes, arena);
}

Stream& CudaBackend::compute_stream() { return *compute_; }

Stream& CudaBackend::create_stream(const std::string& name, StreamPlane plane) {
  DeviceGuard guard(device_);
  cudaStream_t h = nullptr;
  check(cudaStreamCreateWithFlags(&h, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return streams_.add(name, plane, h);
}

CudaBackend::CudaStream& CudaBackend::cuda_stream(const Stream& stream) const { return streams_.of(stream); }

namespace {
const CudaEvent& cuda_event(const StreamEvent& event, const CudaBackend* backend) {
  const auto* e = dynamic_cast<const CudaEvent*>(&event);
  if (!e || e->owner() != backend) throw InvalidArgument("an event recorded by another backend was given to a CUDA backend");
  return *e;
}
}  // namespace

std::shared_ptr<StreamEvent> CudaBackend::record(Stream& stream) {
  return std::make_shared<CudaEvent>(this, cuda_stream(stream).handle.load(), nullptr);
}

std::shared_ptr<StreamEvent> CudaBackend::record_done(Stream& stream, std::shared_ptr<Event> done) {
  if (!done) throw InvalidArgument("record_done: no completion flag given");
  auto event = std::make_shared<CudaEvent>(this, cuda_stream(stream).handle.load(), done);
  // Recorded by whoever sets `done` (the comm queue's issuing thread, once
  // the collective is on the stream), before it issues anything else. A
  // failed record is left to the waiter's: recorded() tries again and raises.
  done->on_set([weak = std::weak_ptr<const CudaEvent>(event)] {
    if (auto e = weak.lock()) {
      try {
        e->recorded();
      } catch (...) {
      }
    }
  });
  return event;
}

void CudaBackend::wait(Stream& stream, const StreamEvent& event) {
  const cudaStream_t h = cuda_stream(stream).handle.load();
  const cudaEvent_t e = cuda_event(event, this).resolved();
  DeviceGuard guard(device_);
  check(cudaStreamWaitEvent(h, e, 0), "cudaStreamWaitEvent");
}

void CudaBackend::host_wait(const StreamEvent& event) {
  const CudaEvent& ce = cuda_event(event, this);
  watched_wait([this, &ce](double seconds) {
    if (seconds < 0) {
      const cudaEvent_t e = ce.resolved();
      DeviceGuard guard(device_);
      check(cudaEventSynchronize(e), "cudaEventSynchronize");
      return true;
    }
    // Watched: polled, so that the wait can end (cudaEventSynchronize
    // cannot be cut short). The pause between polls grows to
    // kLongestPollPause, so a short wait costs little latency and a long one
    // little host time.
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    auto pause = std::chrono::microseconds(10);
    for (;;) {
      if (!ce.pending()) {
        DeviceGuard guard(device_);
        const cudaError_t err = cudaEventQuery(ce.resolved());  // raises a failed collective's error
        if (err == cudaSuccess) return true;
        if (err != cudaErrorNotReady) check(err, "cudaEventQuery");
        (void)cudaGetLastError();
      }
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(pause);
      pause = std::min(2 * pause, kLongestPollPause);
    }
  });
}

bool CudaBackend::query(const StreamEvent& event) {
  const CudaEvent& ce = cuda_event(event, this);
  if (ce.pending()) return false;
  const cudaEvent_t e = ce.recorded();  // a failed collective's error is host_wait's to raise
  DeviceGuard guard(device_);
  const cudaError_t err = cudaEventQuery(e);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void CudaBackend::check_device(const char* op, const char* what, const Tensor& t, bool host_ok) const {
  const Device mine{DeviceType::kCUDA, device_};
  if (t.device() == mine || (host_ok && t.device().type == DeviceType::kCPU)) return;
  throw InvalidArgument(std::string(op) + ": " + what + " is on " + where(t) + ", not cuda:" + std::to_string(device_) +
                        (host_ok ? " or the host" : "") + " (this backend's device)");
}

bool CudaBackend::runs_on_host(const std::string& op, const KernelOperands& operands) const {
  std::vector<std::pair<std::string, bool>> sides;
  for (const auto& [name, t] : operands) {
    const bool host = t->device().type == DeviceType::kCPU;
    if (!host) check_device(op.c_str(), name.c_str(), *t, false);
    sides.emplace_back(name, host);
  }
  return kernel_on_host(op, sides);
}

void CudaBackend::copy(Stream& stream, const Tensor& dst, const Tensor& src) {
  const cudaStream_t h = cuda_stream(stream).handle.load();
  check_device("copy", "dst", dst, true);
  check_device("copy", "src", src, true);
  if (dst.dtype() != src.dtype() || dst.numel() != src.numel()) {
    throw InvalidArgument(std::string("copy: ") + std::to_string(src.numel()) + " " + dtype_name(src.dtype()) +
                          " elements into " + std::to_string(dst.numel()) + " " + dtype_name(dst.dtype()) +
                          " (a copy does not convert; use accumulate into zeros to cast)");
  }
  if (dst.numel() == 0) return;
  DeviceGuard guard(device_);
  if (dst.device().type == DeviceType::kCPU && src.device().type == DeviceType::kCPU) {
    // cudaMemcpyAsync copies host to host at once, on the calling thread,
    // not in the stream's order; a host function keeps the order.
    launch_host_work(h, [d = dst.data(), s = src.data(), bytes = dst.nbytes()] { std::memcpy(d, s, bytes); },
                     "cudaLaunchHostFunc(host to host copy)");
    return;
  }
  if (src.device().type == DeviceType::kCPU && pageable(src.data())) {
    // CUDA stages a pageable source into its own pinned memory when the
    // copy is issued, not when the stream reaches it (seen on an H200): the
    // host first waits for what the stream was given before (a host
    // function filling the source, say).
    check(cudaStreamSynchronize(h), "cudaStreamSynchronize(before a copy from pageable memory)");
  }
  check(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDefault, h), "cudaMemcpyAsync");
}

template <typename OnHost, typename OnDevice>
void CudaBackend::dispatch(Stream& stream, const std::string& op, const KernelOperands& operands, OnHost on_host,
                           OnDevice on_device) {
  const cudaStream_t h = cuda_stream(stream).handle.load();
  if (runs_on_host(op, operands)) {
    DeviceGuard guard(device_);
    const std::string what = "cudaLaunchHostFunc(" + op + " on the host)";
    launch_host_work(h, std::move(on_host), what.c_str());
    return;
  }
  on_device(h);
}

void CudaBackend::fill(Stream& stream, const Tensor& dst, float value) {
  dispatch(stream, "fill", {{"dst", &dst}}, [dst, value] { zerocore::fill(dst, value); },
           [&](cudaStream_t h) { cuda_fill(dst, value, h); });
}

void CudaBackend::accumulate(Stream& stream, const Tensor& dst, const Tensor& src) {
  dispatch(stream, "accumulate", {{"dst", &dst}, {"src", &src}}, [dst, src] { zerocore::accumulate(dst, src); },
           [&](cudaStream_t h) { cuda_accumulate(dst, src, h); });
}

void CudaBackend::accumulate_on_grid(Stream& stream, const Tensor& dst, const Tensor& src, int exponent,
                                     const Tensor& largest) {
  dispatch(stream, "accumulate_on_grid", {{"dst", &dst}, {"src", &src}, {"largest", &largest}},
           [dst, src, exponent, largest] { zerocore::accumulate_on_grid(dst, src, exponent, largest); },
           [&](cudaStream_t h) { cuda_accumulate_on_grid(dst, src, exponent, largest, h); });
}

void CudaBackend::sum_of_squares(Stream& stream, const std::vector<Tensor>& xs, Mailbox& box, int sum_slot,
                                 int finite_slot) {
  double* sum = box.slot(sum_slot);
  double* finite = box.slot(finite_slot);
  dispatch(stream, "sum_of_squares", sum_operands(xs),
           [xs, memory = box.buffer(), sum, finite] { sum_of_squares_into(xs, sum, finite); },
           [&](cudaStream_t h) { cuda_sum_of_squares(xs, device_, sum, finite, h); });
}

void CudaBackend::count_nonfinite(Stream& stream, const std::vector<Tensor>& xs, const Tensor& counter) {
  KernelOperands operands = sum_operands(xs);
  operands.emplace_back("counter", &counter);
  dispatch(stream, "count_nonfinite", operands, [xs, counter] { count_nonfinite_into(xs, counter); },
           [&](cudaStream_t h) { cuda_count_nonfinite(xs, device_, counter, h); });
}

void CudaBackend::adam_update_runs(Stream& stream, const std::vector<AdamOptions>& groups, int64_t step,
                                   double grad_scale, const std::vector<FlatRun>& runs, const Tensor& skip_if) {
  dispatch(stream, "adam_update_runs", update_operands(runs, skip_if),  // on the host: the offloaded step
           [groups, step, grad_scale, runs, skip_if] {
             if (!skipped(skip_if)) zerocore::adam_update_runs(groups, step, grad_scale, runs);
           },
           [&](cudaStream_t h) { cuda_adam_update_runs(groups, step, grad_scale, runs, h, skip_if.data_as<float>()); });
}

void CudaBackend::sgd_update_runs(Stream& stream, const std::vector<SgdOptions>& groups, int64_t step,
                                  double grad_scale, const std::vector<FlatRun>& runs, const Tensor& skip_if) {
  dispatch(stream, "sgd_update_runs", update_operands(runs, skip_if),
           [groups, step, grad_scale, runs, skip_if] {
             if (!skipped(skip_if)) zerocore::sgd_update_runs(groups, step, grad_scale, runs);
           },
           [&](cudaStream_t h) { cuda_sgd_update_runs(groups, step, grad_scale, runs, h, skip_if.data_as<float>()); });
}

void CudaBackend::enqueue(Stream& stream, const std::string&, const std::vector<Access>&, std::function<void()> body) {
  cuda_stream(stream);  // the stream must be this backend's
  DeviceGuard guard(device_);
  body();
}

void CudaBackend::declare_access(Stream&, const Access&, const std::string&) {}

void CudaBackend::declare_host_access(const Access&, const std::string&) {}

void CudaBackend::poison(Stream& stream, const Tensor& range) {
  const cudaStream_t h = cuda_stream(stream).handle.load();
  check_device("poison", "range", range, true);
  if (range.numel() == 0 || !options_.poison_released) return;
  DeviceGuard guard(device_);
  if (range.device().type == DeviceType::kCUDA) {
    check(cudaMemsetAsync(range.data(), 0xFF, range.nbytes(), h), "cudaMemsetAsync(poison)");
    return;
  }
  launch_host_work(h, [data = range.data(), bytes = range.nbytes()] { std::memset(data, 0xFF, bytes); },
                   "cudaLaunchHostFunc(poison)");
}

}  // namespace zerocore
