#include "zerocore/kernels/cpu_exact_grid.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "zerocore/error.h"
#include "zerocore/half.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore {

namespace {
#include "cpu_vec_scalar.h"

// x + 1.5 * 2**52, for |x| < 2**51, lies in [2**52, 2**53), where doubles
// are the integers: the addition rounds x to an integer, ties to even (the
// constant is even), and its bits less the constant's are that integer.
constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2**52
constexpr double kMagicRange = 2251799813685248.0;  // 2**51

__extension__ typedef unsigned __int128 Uint128;  // GCC's and Clang's: no ISO C++ type is as wide

int64_t bits_of(double x) {
  int64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// r (a grad times 2**-exponent, exact) rounded to an integer, ties to even;
// 0 past int64 or not finite (the step is skipped there).
int64_t onto_grid(double r) {
  if (std::fabs(r) < kMagicRange) return bits_of(r + kMagic) - bits_of(kMagic);
  return std::fabs(r) < 9.2e18 ? int64_t(std::nearbyint(r)) : 0;
}

}  // namespace

double quantize_to_grid(const Tensor& src, const Tensor& dst, int exponent) {
  if (src.device().type != DeviceType::kCPU || dst.device().type != DeviceType::kCPU) {
    throw TypeMismatch("quantize_to_grid: tensors must be on the host");
  }
  if (dst.dtype() != DType::kInt64) throw TypeMismatch("quantize_to_grid: dst must be int64");
  if (dst.numel() != src.numel()) {
    throw InvalidArgument("quantize_to_grid: " + std::to_string(src.numel()) + " elements into " +
                          std::to_string(dst.numel()));
  }
  const double scale = std::ldexp(1.0, -exponent);  // a power of two: x * scale is exact in double
  const int64_t magic_bits = bits_of(kMagic), n = src.numel();
  int64_t* d = static_cast<int64_t*>(dst.data());
  double peak = 0.0;
  kernels::with_element_type(src.dtype(), [&](auto s_type) {
    using S = decltype(s_type);
    const S* s = static_cast<const S*>(src.data());
    // The largest |src| first (rounding is monotonic: the largest result
    // is it, rounded), in four lanes the compiler can vectorise; a NaN or
    // an inf fails `a <= FLT_MAX`.
    float lane[4] = {0, 0, 0, 0};
    bool finite = true;
    for (int64_t i = 0; i < n; ++i) {
      const float a = std::fabs(float(kernels::load<ScalarVec>(s + i)));
      finite &= a <= std::numeric_limits<float>::max();
      lane[i & 3] = std::max(lane[i & 3], a);
    }
    if (!finite) {
      peak = HUGE_VAL;
      return;
    }
    peak = std::nearbyint(double(std::max(std::max(lane[0], lane[1]), std::max(lane[2], lane[3]))) * scale);
    if (peak < kMagicRange) {  // every element: no branch
      for (int64_t i = 0; i < n; ++i) d[i] = bits_of(double(kernels::load<ScalarVec>(s + i)) * scale + kMagic) - magic_bits;
      return;
    }
    for (int64_t i = 0; i < n; ++i) {  // past 2**51, and maybe int64: the step widens the grid
      const double r = std::nearbyint(double(kernels::load<ScalarVec>(s + i)) * scale);
      d[i] = std::fabs(r) < 9.2e18 ? int64_t(r) : 0;
    }
  });
  return peak;
}

void accumulate_on_grid(const Tensor& dst, const Tensor& src, int exponent) {
  if (src.device().type != DeviceType::kCPU || dst.device().type != DeviceType::kCPU) {
    throw TypeMismatch("accumulate_on_grid: tensors must be on the host");
  }
  if (dst.dtype() != DType::kInt64) throw TypeMismatch("accumulate_on_grid: dst must be int64");
  if (dst.numel() != src.numel()) {
    throw InvalidArgument("accumulate_on_grid: " + std::to_string(src.numel()) + " elements into " +
                          std::to_string(dst.numel()));
  }
  const double scale = std::ldexp(1.0, -exponent);  // a power of two: x * scale is exact in double
  int64_t* d = static_cast<int64_t*>(dst.data());
  kernels::with_element_type(src.dtype(), [&](auto s_type) {
    using S = decltype(s_type);
    const S* s = static_cast<const S*>(src.data());
    for (int64_t i = 0, n = src.numel(); i < n; ++i) d[i] += onto_grid(double(kernels::load<ScalarVec>(s + i)) * scale);
  });
}

std::array<uint64_t, 3> exact_sum_of_squares(const Tensor& sums) {
  if (sums.device().type != DeviceType::kCPU) throw TypeMismatch("exact_sum_of_squares: the tensor must be on the host");
  Uint128 low = 0;  // the sum modulo 2**128
  uint64_t carries = 0;       // and its multiples of 2**128
  const auto add = [&](int64_t x) {
    const uint64_t a = x < 0 ? uint64_t(0) - uint64_t(x) : uint64_t(x);
    const Uint128 square = Uint128(a) * a;
    low += square;
    carries += low < square;
  };
  const int64_t n = sums.numel();
  if (sums.dtype() == DType::kInt64) {
    const int64_t* x = static_cast<const int64_t*>(sums.data());
    for (int64_t i = 0; i < n; ++i) add(x[i]);
  } else if (sums.dtype() == DType::kInt40) {
    const uint8_t* x = static_cast<const uint8_t*>(sums.data());
    for (int64_t i = 0; i < n; ++i) add(kernels::load_int40(x + 5 * i));
  } else {
    throw TypeMismatch("exact_sum_of_squares: the sums must be int64 or int40");
  }
  return {uint64_t(low), uint64_t(low >> 64), carries};
}

}  // namespace zerocore
