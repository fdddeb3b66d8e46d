#include "zerocore/kernels/cpu_exact_grid.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
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

__extension__ typedef unsigned __int128 Uint128;  // GCC's and Clang's: no ISO C++ type is as wide

int64_t bits_of(double x) {
  int64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace

void accumulate_on_grid(const Tensor& dst, const Tensor& src, int exponent, const Tensor& largest) {
  if (src.device().type != DeviceType::kCPU || dst.device().type != DeviceType::kCPU ||
      largest.device().type != DeviceType::kCPU) {
    throw TypeMismatch("accumulate_on_grid: tensors must be on the host");
  }
  if (dst.dtype() != DType::kInt64) throw TypeMismatch("accumulate_on_grid: dst must be int64");
  if (largest.dtype() != DType::kFloat32 || largest.numel() != 1) {
    throw TypeMismatch("accumulate_on_grid: largest must be one float32 element");
  }
  if (dst.numel() != src.numel()) {
    throw InvalidArgument("accumulate_on_grid: " + std::to_string(src.numel()) + " elements into " +
                          std::to_string(dst.numel()));
  }
  const double scale = std::ldexp(1.0, -exponent);  // a power of two: x * scale is exact in double
  const uint64_t magic_bits = uint64_t(bits_of(kMagic));
  const int64_t n = src.numel();
  uint64_t* d = static_cast<uint64_t*>(dst.data());  // unsigned: adds modulo 2**64, never overflow
  float* top = static_cast<float*>(largest.data());
  uint32_t top_bits = float_bits(*top) & 0x7FFFFFFFu;  // |x|'s bits order as |x|, a NaN's above an inf's
  kernels::with_element_type(src.dtype(), [&](auto s_type) {
    using S = decltype(s_type);
    const S* s = static_cast<const S*>(src.data());
    for (int64_t i = 0; i < n; ++i) {
      const float x = kernels::load<ScalarVec>(s + i);
      top_bits = std::max(top_bits, float_bits(x) & 0x7FFFFFFFu);
      d[i] += uint64_t(bits_of(double(x) * scale + kMagic)) - magic_bits;
    }
  });
  *top = bits_float(top_bits);
}

namespace {

// The sum at element i of int64 or int40 sums.
class SumReader {
 public:
  SumReader(const char* name, const Tensor& sums) : data_(static_cast<const uint8_t*>(sums.data())) {
    if (sums.device().type != DeviceType::kCPU) throw TypeMismatch(std::string(name) + ": the sums must be on the host");
    if (sums.dtype() != DType::kInt64 && sums.dtype() != DType::kInt40) {
      throw TypeMismatch(std::string(name) + ": the sums must be int64 or int40");
    }
    int40_ = sums.dtype() == DType::kInt40;
  }
  int64_t operator[](int64_t i) const {
    if (int40_) return kernels::load_int40(data_ + 5 * i);
    int64_t x;
    std::memcpy(&x, data_ + 8 * i, sizeof x);
    return x;
  }

 private:
  const uint8_t* data_;
  bool int40_ = false;
};

std::array<uint64_t, 3> squares_of(const SumReader& sums, int64_t first, int64_t length) {
  Uint128 low = 0;        // the sum modulo 2**128
  uint64_t carries = 0;   // and its multiples of 2**128
  for (int64_t i = first; i < first + length; ++i) {
    const int64_t x = sums[i];
    const uint64_t a = x < 0 ? uint64_t(0) - uint64_t(x) : uint64_t(x);
    const Uint128 square = Uint128(a) * a;
    low += square;
    carries += low < square;
  }
  return {uint64_t(low), uint64_t(low >> 64), carries};
}

void check_runs(const char* name, const std::vector<GridRun>& runs, int64_t numel) {
  int64_t end = 0;
  for (const GridRun& r : runs) {
    if (r.first < end || r.length < 0 || r.first + r.length > numel) {
      throw InvalidArgument(std::string(name) + ": runs must be in order, apart, within the " +
                            std::to_string(numel) + " sums");
    }
    end = r.first + r.length;
  }
}

}  // namespace

std::vector<std::array<uint64_t, 3>> exact_sums_of_squares(const Tensor& sums, const std::vector<GridRun>& runs) {
  const SumReader reader("exact_sums_of_squares", sums);
  check_runs("exact_sums_of_squares", runs, sums.numel());
  std::vector<std::array<uint64_t, 3>> out;
  out.reserve(runs.size());
  for (const GridRun& r : runs) out.push_back(squares_of(reader, r.first, r.length));
  return out;
}

void mean_of_sums(const Tensor& sums, const Tensor& grads, const std::vector<GridRun>& runs, int64_t count) {
  const SumReader reader("mean_of_sums", sums);
  if (grads.device().type != DeviceType::kCPU) throw TypeMismatch("mean_of_sums: the grads must be on the host");
  if (grads.numel() != sums.numel()) {
    throw InvalidArgument("mean_of_sums: " + std::to_string(sums.numel()) + " sums for " +
                          std::to_string(grads.numel()) + " grads");
  }
  if (count < 1) throw InvalidArgument("mean_of_sums: the count must be positive");
  check_runs("mean_of_sums", runs, sums.numel());
  const double divisor = double(count);
  kernels::with_element_type(grads.dtype(), [&](auto g_type) {
    using G = decltype(g_type);
    G* g = static_cast<G*>(grads.data());
    for (const GridRun& r : runs) {
      if (!r.exponent) {  // padding
        for (int64_t i = r.first; i < r.first + r.length; ++i) kernels::store<ScalarVec>(g + i, 0.0f);
        continue;
      }
      const double scale = std::ldexp(1.0, *r.exponent);
      for (int64_t i = r.first; i < r.first + r.length; ++i) {
        const float mean = float(double(reader[i]) * scale / divisor);  // read before the write over it
        kernels::store<ScalarVec>(g + i, mean);
      }
    }
  });
}

}  // namespace zerocore
