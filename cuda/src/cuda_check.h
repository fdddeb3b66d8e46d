// Turning CUDA runtime errors into zerocore exceptions, and a guard that
// makes a device current for the duration of a call. Internal to cuda/.
#pragma once
#include <cuda_runtime_api.h>

namespace zerocore::cuda_detail {

// Throws when `err` is not cudaSuccess: InvalidArgument for errors caused by
// the caller's arguments (bad device, stream or pointer), std::runtime_error
// for everything else. The message names `what` and carries CUDA's text.
// Clears the runtime's last-error state so the error is not reported twice.
void check(cudaError_t err, const char* what);

// Makes `device` current and restores the previous device on exit, so a
// call never leaves the caller (e.g. torch) on a different device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace zerocore::cuda_detail
