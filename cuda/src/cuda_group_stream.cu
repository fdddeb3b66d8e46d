// CUDA's GroupStream (zerocore/cuda_group_stream.h).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_check.h"
#include "zerocore/cuda_group_stream.h"
#include "zerocore/error.h"

namespace zerocore {

namespace {

using cuda_detail::check;
using cuda_detail::DeviceGuard;

// Holds the stream for `nanoseconds` of the device's global timer: the
// collective's data moves only after it, as an NCCL collective waiting for
// a slow peer would.
__global__ void spin_kernel(uint64_t nanoseconds) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

// An event recorded on a rank's stream, destroyed with the mark (CUDA keeps
// what waits for it valid).
class CudaMark final : public GroupStream::Mark {
 public:
  CudaMark(int device, cudaStream_t stream) : device_(device) {
    DeviceGuard guard(device_);
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t recorded = cudaEventRecord(event_, stream);
    if (recorded != cudaSuccess) (void)cudaEventDestroy(event_);
    check(recorded, "cudaEventRecord");
  }
  ~CudaMark() override {
    DeviceGuard guard(device_);
    (void)cudaEventDestroy(event_);
  }
  CudaMark(const CudaMark&) = delete;
  CudaMark& operator=(const CudaMark&) = delete;
  cudaEvent_t event() const { return event_; }

 private:
  const int device_;
  cudaEvent_t event_ = nullptr;
};

class CudaGroupStream final : public GroupStream {
 public:
  CudaGroupStream(CudaBackend& backend, Stream& stream)
      : backend_(backend), stream_(stream), handle_(static_cast<cudaStream_t>(backend.handle(stream))) {}

  std::shared_ptr<Mark> mark() override { return std::make_shared<CudaMark>(backend_.device(), handle_); }
  void wait(const Mark& peer) override {
    const auto* m = dynamic_cast<const CudaMark*>(&peer);
    if (!m) throw InvalidArgument("cuda_group_stream: a peer's mark is of another flavour");
    DeviceGuard guard(backend_.device());
    check(cudaStreamWaitEvent(handle_, m->event(), 0), "cudaStreamWaitEvent(a peer's mark)");
  }
  void copy(const Tensor& dst, const Tensor& src) override { backend_.copy(stream_, dst, src); }
  void zero(const Tensor& dst) override { backend_.fill(stream_, dst, 0.0f); }
  void add(const Tensor& dst, const Tensor& src) override { backend_.accumulate(stream_, dst, src); }
  void delay(int microseconds) override {
    DeviceGuard guard(backend_.device());
    spin_kernel<<<1, 1, 0, handle_>>>(uint64_t(microseconds) * 1000);
    check(cudaGetLastError(), "spin_kernel (late completion)");
  }
  Backend& backend() override { return backend_; }
  Completion completion(std::shared_ptr<Mark>) override { return {}; }

 private:
  CudaBackend& backend_;
  Stream& stream_;
  const cudaStream_t handle_;
};

}  // namespace

std::unique_ptr<GroupStream> cuda_group_stream(CudaBackend& backend, Stream& stream) {
  return std::make_unique<CudaGroupStream>(backend, stream);
}

}  // namespace zerocore
