// Device discovery. Safe without a driver: the static CUDA runtime loads
// libcuda lazily, on the first call, and reports its absence as an error,
// which here means "no devices".
#include <cuda_runtime_api.h>

#include <string>

#include "zerocore/cuda_optim.h"

namespace zerocore {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. cudaErrorNoDevice / cudaErrorInsufficientDriver
    return 0;
  }
  return count;
}

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
  }
  return count > 0 ? std::string() : std::string("no CUDA device is visible");
}

}  // namespace zerocore
