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

// src * 2**-exponent rounded to integers, ties to even, handed to
// put(dst[i], value) (which stores or adds it); returns the largest |value|
// (a rounded double), or +inf when some src[i] is not finite (dst is then
// left as it was, as where a value is beyond int64: the caller skips the step).
template <class Put>
double onto_grid(const char* name, const Tensor& src, const Tensor& dst, int exponent, Put put) {
  if (src.device().type != DeviceType::kCPU || dst.device().type != DeviceType::kCPU) {
    throw TypeMismatch(std::string(name) + ": tensors must be on the host");
  }
  if (dst.dtype() != DType::kInt64) throw TypeMismatch(std::string(name) + ": dst must be int64");
  if (dst.numel() != src.numel()) {
    throw InvalidArgument(std::string(name) + ": " + std::to_string(src.numel()) + " elements into " +
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
      for (int64_t i = 0; i < n; ++i) put(d[i], bits_of(double(kernels::load<ScalarVec>(s + i)) * scale + kMagic) - magic_bits);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {  // past 2**51, and maybe int64: the step widens the grid
      const double r = std::nearbyint(double(kernels::load<ScalarVec>(s + i)) * scale);
      put(d[i], std::fabs(r) < 9.2e18 ? int64_t(r) : 0);
    }
  });
  return peak;
}

}  // namespace

double quantize_to_grid(const Tensor& src, const Tensor& dst, int exponent) {
  return onto_grid("quantize_to_grid", src, dst, exponent, [](int64_t& d, int64_t v) { d = v; });
}

void accumulate_on_grid(const Tensor& dst, const Tensor& src, int exponent) {
  onto_grid("accumulate_on_grid", src, dst, exponent, [](int64_t& d, int64_t v) { d += v; });
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
