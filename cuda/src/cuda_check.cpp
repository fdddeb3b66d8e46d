#include "cuda_check.h"

#include <stdexcept>
#include <string>

#include "zerocore/error.h"

namespace zerocore::cuda_detail {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // non-sticky errors would otherwise resurface later
  std::string msg = std::string("zerocore: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")";
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:  // e.g. a stream of another device or a destroyed one
    case cudaErrorInvalidDevicePointer:
      throw InvalidArgument(msg);
    default:
      throw std::runtime_error(msg);
  }
}

DeviceGuard::DeviceGuard(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    check(cudaSetDevice(device), "cudaSetDevice");
  } else {
    previous_ = -1;  // nothing to restore
  }
}

DeviceGuard::~DeviceGuard() {
  // A destructor must not throw; failing to switch back is not worth losing
  // the original exception over.
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

}  // namespace zerocore::cuda_detail
