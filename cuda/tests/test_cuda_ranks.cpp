// Several ranks on one GPU, in one process: tests/cpp/stream_group_ranks.h's
// cases (every collective bit for bit at fp32 and bf16, ranks issuing
// different collectives, stage 3's unit schedule, the bucket reducer and
// the step) at world sizes 2 and 4 over a StreamGroup whose ranks are
// threads, each with a CudaBackend of its own on device 0 (its own compute
// stream, released memory poisoned with NaN) and cuda_group_stream's
// stream-ordered collectives, without and with late completion (a spinning
// kernel before each collective's data moves). The same cases run on the
// CPU backends in test_stream_group.
//   test_cuda_ranks gpu   exits 77 (ctest: skipped) without a device.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>
#include <string>

#include "stream_group_ranks.h"
#include "zerocore/cuda_group_stream.h"
#include "zerocore/cuda_optim.h"

using namespace zerocore;

namespace {

// A rank's backend on device 0 with a compute stream of its own (the
// legacy default stream would order every rank's compute behind every
// other's, hiding a missing wait between them).
class RankBackend final : public CudaBackend {
 public:
  RankBackend() : CudaBackend(0, new_stream(), options()) {}
  ~RankBackend() override { (void)cudaStreamDestroy(static_cast<cudaStream_t>(handle(compute_stream()))); }

 private:
  static void* new_stream() {
    cudaStream_t s = nullptr;
    if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
      throw std::runtime_error("cannot make a stream on cuda:0");
    }
    return s;
  }
  static CudaBackendOptions options() {
    CudaBackendOptions o;
    o.poison_released = true;
    return o;
  }
};

test::RankDevices on_one_gpu() {
  return {[](int) { return std::make_unique<RankBackend>(); },
          [](Backend& backend, Stream& stream) {
            return cuda_group_stream(static_cast<CudaBackend&>(backend), stream);
          }};
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "gpu";
  if (mode != "gpu") {
    std::fprintf(stderr, "usage: %s [gpu]\n", argv[0]);
    return 2;
  }
  if (cuda_device_count() == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  test::check_stream_group(on_one_gpu(), std::nullopt);
  test::check_stream_group(on_one_gpu(), LateCompletion{21, 2000});
  return test::finish("test_cuda_ranks");
}
