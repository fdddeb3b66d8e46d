// Launch geometry shared by the CUDA kernels: block size, a grid that fills
// the device once, and the alignment test for packed access. Internal to
// cuda/.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zerocore::cuda_detail {

constexpr int kThreads = 256;  // every kernel's __launch_bounds__

// Enough blocks of kThreads to fill every SM of `device` once (grid-stride
// loops do the rest), never more than `blocks_needed`, at least one.
int grid_size(int device, int64_t blocks_needed);

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace zerocore::cuda_detail
