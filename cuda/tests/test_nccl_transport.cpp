// C++ tests of the native NCCL transport (zerocore/nccl_transport.h).
//   test_nccl_transport args  the loader's errors (a missing library names
//                             its path and the fallback; a library without
//                             NCCL's entry points names the missing one) and,
//                             where ZEROCORE_NCCL_LIBRARY names a real NCCL,
//                             its version and a unique id's size: no GPU
//                             needed;
//   test_nccl_transport gpu   at world size 1 on device 0: each collective
//                             moves its data on the given stream in every
//                             dtype, with an empty completion (the stream
//                             orders it), and a collective stuck behind a
//                             slow stream is timed out by the watchdog: the
//                             next collective throws CollectiveTimeout
//                             naming it, and so does every later one.
//                             Exits 77 (ctest: skipped) without a device.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "test_modes.h"
#include "zerocore/error.h"
#include "zerocore/nccl_transport.h"

using namespace zerocore;

namespace {

using cuda_tests::has;
using cuda_tests::message_of;

std::string library_from_env() {
  const char* path = std::getenv("ZEROCORE_NCCL_LIBRARY");
  return path ? path : "";
}

void test_args() {
  const std::string missing = message_of<std::runtime_error>([] { load_nccl("/nonexistent/libnccl.so.2"); });
  CHECK(has(missing, "cannot load NCCL from /nonexistent/libnccl.so.2"));
  CHECK(has(missing, "Config(nccl=\"torch\")"));
  // A real shared library that is not NCCL.
  const std::string not_nccl = message_of<std::runtime_error>([] { load_nccl("libm.so.6"); });
  CHECK(has(not_nccl, "libm.so.6 has no ncclGetVersion"));
  CHECK(has(not_nccl, "ZEROCORE_NCCL_LIBRARY"));

  const std::string path = library_from_env();
  if (path.empty()) {
    std::printf("ZEROCORE_NCCL_LIBRARY unset: the real library's checks skipped\n");
    return;
  }
  auto nccl = load_nccl(path);
  CHECK(load_nccl(path) == nccl);  // once per path
  CHECK(nccl_path(*nccl) == path);
  CHECK(nccl_version(*nccl) / 10000 == 2);
  CHECK(has(message_of<InvalidArgument>([&] { nccl_transport(nccl, "short", {}); }), "128 bytes"));
  CHECK(has(message_of<InvalidArgument>([&] { nccl_transport(nccl, std::string(128, '\0'), {2, 2, 0, 1.0}); }),
            "rank 2 of world size 2"));
}

void check_cuda(cudaError_t err) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "CUDA: %s\n", cudaGetErrorString(err));
    std::exit(1);
  }
}

// A device buffer of `n` elements of `dtype`, each element's bytes `byte`.
Tensor device_tensor(int64_t n, DType dtype, int byte) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, size_t(n) * dtype_size(dtype)));
  check_cuda(cudaMemset(p, byte, size_t(n) * dtype_size(dtype)));
  return Tensor(p, dtype, Device{DeviceType::kCUDA, 0}, {n}, std::shared_ptr<void>(p, [](void* q) { cudaFree(q); }));
}

std::vector<unsigned char> bytes_of(const Tensor& t) {
  std::vector<unsigned char> out(t.nbytes());
  check_cuda(cudaMemcpy(out.data(), t.data(), out.size(), cudaMemcpyDeviceToHost));
  return out;
}

void sleep_on_stream(void* seconds) { sleep(*static_cast<unsigned*>(seconds)); }

void test_gpu() {
  auto nccl = load_nccl(library_from_env());
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A collective's completion is empty: it is done once the stream is.
  auto done = [&](const Completion& completion) {
    CHECK(!completion);
    check_cuda(cudaStreamSynchronize(stream));
  };
  auto transport = nccl_transport(nccl, nccl_unique_id(*nccl), {0, 1, 0, 5.0});
  transport->issue_on(stream);
  CHECK(transport->rank() == 0 && transport->world_size() == 1);
  const CollectiveKey key{CollectiveKind::kAllGather, 0, 0, 1000};
  // At world size 1 every collective copies its input (or keeps it): the
  // output, filled with other bytes, must hold the input's afterwards. The
  // bytes 0x3c make a finite value in every dtype, so a sum keeps them.
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const Tensor input = device_tensor(1000, dtype, 0x3c);
    const std::vector<unsigned char> want = bytes_of(input);
    Tensor output = device_tensor(1000, dtype, 0);
    done(transport->all_gather(key, input, output));
    CHECK(bytes_of(output) == want);
    output = device_tensor(1000, dtype, 0);
    done(transport->reduce_scatter(key, input, output));
    CHECK(bytes_of(output) == want);
    done(transport->all_reduce(key, input));
    CHECK(bytes_of(input) == want);
    done(transport->broadcast(key, input, 0));
    CHECK(bytes_of(input) == want);
  }
  CHECK(has(message_of<InvalidArgument>([&] {
              transport->all_gather(key, device_tensor(10, DType::kFloat32, 0), device_tensor(20, DType::kFloat32, 0));
            }),
            "sizes"));
  // A collective behind 3 s of the stream's own work, with a 1 s timeout.
  auto slow = nccl_transport(nccl, nccl_unique_id(*nccl), {0, 1, 0, 1.0});
  slow->issue_on(stream);
  static unsigned seconds = 3;
  check_cuda(cudaLaunchHostFunc(stream, sleep_on_stream, &seconds));
  const Tensor t = device_tensor(10, DType::kFloat32, 0);
  const CollectiveKey reduce_key{CollectiveKind::kAllReduce, 0, 0, 10};
  CHECK(!slow->all_reduce(reduce_key, t));  // issued: the watchdog times it out after 1 s
  sleep(2);
  for (int later = 0; later < 2; ++later) {
    const std::string timed_out = message_of<CollectiveTimeout>([&] { slow->all_reduce(reduce_key, t); });
    CHECK(has(timed_out, describe(reduce_key) + " timed out after 1 s"));
  }
  // The aborted collective's stream: its state is NCCL's business now, not checked.
  (void)cudaStreamSynchronize(stream);
}

}  // namespace

int main(int argc, char** argv) { return cuda_tests::run_mode(argc, argv, test_args, test_gpu); }
