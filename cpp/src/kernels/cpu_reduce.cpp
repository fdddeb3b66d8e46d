#include "zerocore/kernels/cpu_reduce.h"

#include <cmath>
#include <map>
#include <mutex>
#include <string>

#include "zerocore/error.h"
#include "zerocore/half.h"
#include "zerocore/kernels/element_math.h"
#include "zerocore/runtime/thread_pool.h"

namespace zerocore {

namespace {

#include "cpu_vec_scalar.h"

constexpr int64_t kChunkAlign = 64;

// Four independent accumulators let the loop pipeline; their order is fixed,
// so the result does not depend on timing.
template <class T>
double sum_sq(const T* p, int64_t begin, int64_t end) {
  using kernels::add_square;
  using kernels::load;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    for (int k = 0; k < 4; ++k) acc[k] = add_square<ScalarVec>(acc[k], load<ScalarVec>(p + i + k));
  }
  for (; i < end; ++i) acc[0] = add_square<ScalarVec>(acc[0], load<ScalarVec>(p + i));
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

double sum_sq_of(const Tensor& t, int64_t begin, int64_t end) {
  double s = 0.0;
  kernels::with_element_type(t.dtype(), [&](auto type) {
    s = sum_sq(static_cast<const decltype(type)*>(t.data()), begin, end);
  });
  return s;
}

}  // namespace

double sum_of_squares(const std::vector<Tensor>& xs) {
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].device().type != DeviceType::kCPU) {
      throw TypeMismatch("sum_of_squares: tensor " + std::to_string(i) + " is not on the host");
    }
    lengths.push_back(xs[i].numel());
  }
  // Partial sums keyed by where their piece starts, added in that order.
  std::map<std::pair<size_t, int64_t>, double> partial;
  std::mutex mutex;
  parallel_for_ranges(default_thread_pool(), lengths, kChunkAlign, [&](size_t i, int64_t b, int64_t e) {
    const double s = sum_sq_of(xs[i], b, e);
    std::lock_guard<std::mutex> lock(mutex);
    partial[{i, b}] = s;
  });
  double total = 0.0;
  for (const auto& kv : partial) total += kv.second;
  return total;
}

void sum_of_squares_into(const std::vector<Tensor>& xs, double* sum, double* finite) {
  *sum = sum_of_squares(xs);
  *finite = std::isfinite(*sum) ? 1.0 : 0.0;
}

namespace {

float* one_fp32(const Tensor& t, const char* op, const char* what) {
  if (t.dtype() != DType::kFloat32 || t.numel() != 1 || t.device().type != DeviceType::kCPU) {
    throw TypeMismatch(std::string(op) + ": " + what + " must be one fp32 element on the host");
  }
  return t.data_as<float>();
}

}  // namespace

void count_nonfinite_into(const std::vector<Tensor>& xs, const Tensor& counter) {
  float* count = one_fp32(counter, "count_nonfinite", "the counter");
  if (!std::isfinite(sum_of_squares(xs))) *count += 1.0f;
}

bool skipped(const Tensor& skip_if) {
  return skip_if.data() != nullptr && *one_fp32(skip_if, "an update", "skip_if") != 0.0f;
}

}  // namespace zerocore
