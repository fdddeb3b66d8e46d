// Several arrays cut into fixed-size chunks that blocks take in a
// grid-stride loop (the optimizers' runs, a reduction's tensors), each block
// finding its array in a table in device memory by the chunk's number.
// Internal to cuda/.
#pragma once
#include <cstdint>

#include "launch.h"

namespace zerocore::cuda_detail {

// Elements a block takes at a time; a multiple of the pack width, so every
// chunk of an aligned array starts aligned.
constexpr int64_t kChunk = 16 * kThreads;

inline int64_t chunks_of(int64_t n) { return (n + kChunk - 1) / kChunk; }

// The entry of `table` holding `chunk`: the last whose first_chunk <= chunk.
template <class Entry>
__device__ int entry_of(const Entry* table, int entries, int64_t chunk) {
  int lo = 0, hi = entries - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace zerocore::cuda_detail
