// CUDA's GroupStream (comm/stream_group.h): ranks as threads on one device,
// each with a CudaBackend of its own, whose StreamGroup collectives are
// device work on each rank's comm stream. Marks are CUDA events recorded
// on the stream; a peer's stream waits for one with cudaStreamWaitEvent
// (the ranks share the process's context, so no host wait and no MPS);
// copies are cudaMemcpyAsync between the ranks' device buffers and the sums
// the backend's accumulate kernel; late completion is a kernel that spins
// on the device's clock. The queue's event covers a collective by itself
// (CudaBackend::record_done records the stream once it is issued), so the
// completion is empty. Every call makes the backend's device current on
// the calling thread (the comm queue's issuing thread) first.
// cuda/tests/test_cuda_ranks.cpp runs tests/cpp/stream_group_ranks.h's
// cases with it at world sizes 2 and 4 on device 0.
#pragma once
#include <memory>

#include "zerocore/comm/stream_group.h"
#include "zerocore/cuda_backend.h"

namespace zerocore {

std::unique_ptr<GroupStream> cuda_group_stream(CudaBackend& backend, Stream& stream);

}  // namespace zerocore
