#include "launch.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda_check.h"

namespace zerocore::cuda_detail {

int grid_size(int device, int64_t blocks_needed) {
  int sms = 0, threads_per_sm = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  check(cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device),
        "cudaDeviceGetAttribute(MaxThreadsPerMultiProcessor)");
  const int64_t resident = int64_t(sms) * std::max(1, threads_per_sm / kThreads);
  return int(std::max<int64_t>(1, std::min(resident, blocks_needed)));
}

}  // namespace zerocore::cuda_detail
