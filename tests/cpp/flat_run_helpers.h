// Tensors and runs for the optimizer tests: random values, copies, and
// bitwise comparison.
#pragma once
#include <cstring>
#include <random>

#include "zerocore/zerocore.h"

namespace zerocore::test {

inline Tensor random_tensor(std::mt19937& rng, int64_t n, DType dtype) {
  std::normal_distribution<float> normal;
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) {
    const float x = normal(rng);
    if (dtype == DType::kFloat32) t.data_as<float>()[i] = x;
    if (dtype == DType::kBFloat16) t.data_as<uint16_t>()[i] = float_to_bf16(x);
    if (dtype == DType::kFloat16) t.data_as<uint16_t>()[i] = float_to_fp16(x);
  }
  return t;
}

inline Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype());
  std::memcpy(c.data(), t.data(), t.nbytes());
  return c;
}

inline FlatRun copy_of(const FlatRun& r) {
  auto maybe = [](const Tensor& t) { return t.data() ? copy_of(t) : Tensor(); };
  return FlatRun{r.param_group, copy_of(r.param), r.grad, maybe(r.state0), maybe(r.state1), maybe(r.param_copy)};
}

inline bool same(const Tensor& a, const Tensor& b) {
  return (!a.data() && !b.data()) || (a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

inline bool same(const FlatRun& a, const FlatRun& b) {
  return same(a.param, b.param) && same(a.state0, b.state0) && same(a.state1, b.state1) &&
         same(a.param_copy, b.param_copy);
}

}  // namespace zerocore::test
