// Tables the kernels read from device memory (runs of a partition, tensors
// of a reduction), uploaded once. Internal to cuda/.
#pragma once
#include <cstddef>

namespace zerocore::cuda_detail {

// A copy of `bytes` bytes at `host` in `device`'s memory. A partition's
// tables are the same every step (its arenas are allocated once), so each
// distinct table is uploaded once, on the first call that uses it (a
// synchronous copy), and kept for the life of the process: a few dozen
// bytes an entry, and no allocation, copy or host synchronisation on any
// later call with the same contents.
const void* device_table(int device, const void* host, size_t bytes);

}  // namespace zerocore::cuda_detail
