// Config(deterministic=True)'s grid (python/zerocore/state/exact_grads.py), on
// the host, each in one pass where torch would take several through
// temporaries: a micro-batch's grads as integer multiples of 2**exponent,
// the exact sums of squares of the integer sums and their mean.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "zerocore/tensor.h"

namespace zerocore {

// dst[i] += src[i] * 2**-exponent rounded to the nearest integer, ties to
// even (the scaling is exact: one rounding), modulo 2**64, in one pass with
// no temporary: how gradient reduction stages a grad in deterministic mode
// (Backend::accumulate_on_grid), and stages 0-1 add a micro-batch's grads
// into their sums. src is fp32, bf16 or fp16, dst int64 of as many
// elements, largest one fp32 element, all on the host. largest becomes the
// largest of itself and every |src[i]|, ordered by their bits (a NaN above
// an inf above every finite value, so one not finite stays in it): the
// caller puts it on the grid (rounding is monotonic) once a step. Exact
// where |src[i] * 2**-exponent| < 2**51; past it, or where a src[i] is not
// finite, what dst[i] gets is unspecified: the caller, seeing the largest
// far past the grid's 2**39, skips the step. Throws TypeMismatch or
// InvalidArgument for other tensors.
void accumulate_on_grid(const Tensor& dst, const Tensor& src, int exponent, const Tensor& largest);

// A stretch of one param's sums on one grid (multiples of 2**exponent), or
// of padding (no exponent), at elements [first, first + length) of a rank's
// sums: how the step reads them, a stretch at a time, in one call.
struct GridRun {
  int64_t first = 0;
  int64_t length = 0;
  std::optional<int> exponent;
};

// Per run, the exact sum of the squares of its int64 or int40 sums (|x| <
// 2**63), as 64-bit words, least significant first: sum = w[0] + w[1] *
// 2**64 + w[2] * 2**128 (each square below 2**126, so fewer than 2**64
// elements cannot carry past w[2]). The runs' exponents are not read.
std::vector<std::array<uint64_t, 3>> exact_sums_of_squares(const Tensor& sums, const std::vector<GridRun>& runs);

// The step's gradient from the exact sums of `count` micro-batches:
// grads[i] = double(sums[i]) * 2**exponent / count (two IEEE double
// operations, in that order), rounded to float and then to grads' dtype
// (fp32, bf16 or fp16: what torch's copy_ of the double does), and zero on
// padding; the runs in increasing order. sums int64 or int40, on the host,
// with as many elements as grads. The grads may lie in the sums' own first
// bytes (an int40 grad partition: FlatGroup.buffers["grad_sums"]): element i's
// grad is written after its sum is read and never over a sum not yet read.
void mean_of_sums(const Tensor& sums, const Tensor& grads, const std::vector<GridRun>& runs, int64_t count);

}  // namespace zerocore
