// Config(deterministic=True)'s grid (python/zerocore/state/exact_grads.py), on
// the host, each in one pass where torch would take several through
// temporaries: a micro-batch's grads as integer multiples of 2**exponent,
// and the exact sum of squares of the integer sums.
#pragma once
#include <array>
#include <cstdint>

#include "zerocore/tensor.h"

namespace zerocore {

// dst[i] = src[i] * 2**-exponent rounded to the nearest integer, ties to
// even (the scaling is exact: one rounding), as int64; src is fp32, bf16 or
// fp16, dst int64 of as many elements, both on the host. Returns the
// largest |dst[i]| before the conversion (a rounded double), or +inf when
// some src[i] is not finite (dst is then unspecified there, as where a
// value is beyond int64: the caller skips the step). Throws TypeMismatch or
// InvalidArgument for other tensors.
double quantize_to_grid(const Tensor& src, const Tensor& dst, int exponent);

// dst[i] += src[i] * 2**-exponent rounded as quantize_to_grid rounds it,
// with no temporary: how gradient reduction stages a grad in deterministic
// mode (Backend::accumulate_on_grid). Where some src[i] is not finite dst
// is left as it was, and a value beyond int64 adds 0: the caller, which
// takes the largest |src| itself, skips the step there. dst int64, src
// fp32, bf16 or fp16.
void accumulate_on_grid(const Tensor& dst, const Tensor& src, int exponent);

// The exact sum of the squares of int64 or int40 `sums` (|x| < 2**63), as 64-bit
// words, least significant first: sum = w[0] + w[1] * 2**64 + w[2] * 2**128
// (each square below 2**126, so fewer than 2**64 elements cannot carry past
// w[2]).
std::array<uint64_t, 3> exact_sum_of_squares(const Tensor& sums);

}  // namespace zerocore
