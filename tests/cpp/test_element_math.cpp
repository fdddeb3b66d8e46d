// The shared per-element math (kernels/element_math.h) that the CPU and CUDA
// kernels both instantiate. For every grad/copy dtype combination the CUDA
// kernels take and on every instruction set this machine runs, the CPU
// kernels must equal the element functions instantiated with the scalar
// host ops bit for bit, and be close to a float64 reference of torch.optim;
// accumulate and fill must round exactly as float64-then-cast does, and the
// sum of squares match a float64 sum.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "zerocore/kernels/element_math.h"
#include "zerocore/kernels/optim_args.h"
#include "zerocore/zerocore.h"

namespace zerocore::test_scalar {
#include "cpu_vec_scalar.h"
}  // namespace zerocore::test_scalar

using namespace zerocore;
using Ops = test_scalar::ScalarVec;

namespace {

constexpr int64_t kN = 1037;  // whole AVX-512 and AVX2 vectors plus a tail

std::mt19937 rng(11);

float to_dtype_and_back(DType d, float x) {
  if (d == DType::kBFloat16) return bf16_to_float(float_to_bf16(x));
  if (d == DType::kFloat16) return fp16_to_float(float_to_fp16(x));
  return x;
}

// A tensor of n elements of dtype d holding `values` rounded to d.
Tensor make(DType d, const std::vector<float>& values) {
  Tensor t = Tensor::empty({int64_t(values.size())}, d);
  for (size_t i = 0; i < values.size(); ++i) {
    if (d == DType::kFloat32) t.data_as<float>()[i] = values[i];
    if (d == DType::kBFloat16) t.data_as<uint16_t>()[i] = float_to_bf16(values[i]);
    if (d == DType::kFloat16) t.data_as<uint16_t>()[i] = float_to_fp16(values[i]);
  }
  return t;
}

float at(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::kBFloat16) return bf16_to_float(t.data_as<uint16_t>()[i]);
  if (t.dtype() == DType::kFloat16) return fp16_to_float(t.data_as<uint16_t>()[i]);
  return t.data_as<float>()[i];
}

std::vector<float> random_values(float mean, float spread) {
  std::normal_distribution<float> normal(mean, spread);
  std::vector<float> v(kN);
  for (float& x : v) x = normal(rng);
  return v;
}

Tensor clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype());
  std::memcpy(c.data(), t.data(), t.nbytes());
  return c;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return !is_given(a) ? !is_given(b) : std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Runs f over [0, kN) with the element types of (grad, copy) as pointers:
// the scalar instantiation the kernels must equal.
template <class F>
void each_scalar(const Tensor& grad, const Tensor& copy, F&& f) {
  kernels::with_element_type(grad.dtype(), [&](auto g_type) {
    using G = decltype(g_type);
    const G* g = static_cast<const G*>(grad.data());
    auto run = [&](auto* c) {
      for (int64_t i = 0; i < kN; ++i) f(g, c, i);
    };
    if (!is_given(copy)) {
      run(static_cast<kernels::NoCopy*>(nullptr));
    } else {
      kernels::with_element_type(copy.dtype(), [&](auto c_type) { run(static_cast<decltype(c_type)*>(copy.data())); });
    }
  });
}

// Within a few float roundings of the magnitude of the terms summed.
bool close(double got, double want, double terms) { return std::fabs(got - want) <= 1e-6 * terms; }

void check_adam(DType gd, const Tensor& copy0, bool adamw) {
  AdamOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  o.adamw = adamw;
  const int64_t step = 3;
  const double scale = 0.5;
  const Tensor p0 = make(DType::kFloat32, random_values(0, 1)), g = make(gd, random_values(0, 1));
  const Tensor m0 = make(DType::kFloat32, random_values(0, 0.1f)), v0 = make(DType::kFloat32, random_values(0.2f, 0.05f));

  Tensor p = clone(p0), m = clone(m0), v = clone(v0), copy = is_given(copy0) ? clone(copy0) : Tensor();
  const AdamCoefs c = adam_coefs(o, step, scale);
  each_scalar(g, copy, [&](auto* gp, auto* cp, int64_t i) {
    kernels::adam_at<Ops>(c, p.data_as<float>(), gp, m.data_as<float>(), v.data_as<float>(), cp, i);
  });
  for (int64_t i = 0; i < kN; ++i) {  // torch.optim's Adam(W) in float64
    double pi = at(p0, i), gi = double(at(g, i)) * scale;
    if (adamw) pi *= 1 - o.lr * o.weight_decay;
    if (!adamw) gi += o.weight_decay * at(p0, i);
    const double mi = o.beta1 * at(m0, i) + (1 - o.beta1) * gi;
    const double vi = o.beta2 * at(v0, i) + (1 - o.beta2) * gi * gi;
    pi -= o.lr / (1 - std::pow(o.beta1, step)) * mi / (std::sqrt(vi) / std::sqrt(1 - std::pow(o.beta2, step)) + o.eps);
    CHECK(close(at(p, i), pi, std::fabs(at(p0, i)) + o.lr));
    CHECK(close(at(m, i), mi, std::fabs(at(m0, i)) + std::fabs(gi)));
    CHECK(close(at(v, i), vi, vi));
    if (is_given(copy)) CHECK(at(copy, i) == to_dtype_and_back(copy.dtype(), at(p, i)));
  }
  for (Isa isa : supported_isas()) {
    set_cpu_isa(isa);
    Tensor pk = clone(p0), mk = clone(m0), vk = clone(v0), ck = is_given(copy0) ? clone(copy0) : Tensor();
    adam_update(o, step, scale, pk, g, mk, vk, ck);
    CHECK(same_bits(pk, p) && same_bits(mk, m) && same_bits(vk, v) && same_bits(ck, copy));
  }
}

void check_sgd(DType gd, const Tensor& copy0, bool nesterov, int64_t step) {
  SgdOptions o;
  o.lr = 1e-2;
  o.momentum = 0.9;
  o.dampening = nesterov ? 0.0 : 0.1;
  o.weight_decay = 0.05;
  o.nesterov = nesterov;
  const double scale = 0.5;
  const Tensor p0 = make(DType::kFloat32, random_values(0, 1)), g = make(gd, random_values(0, 1));
  const Tensor b0 = make(DType::kFloat32, random_values(0, 0.1f));

  Tensor p = clone(p0), b = clone(b0), copy = is_given(copy0) ? clone(copy0) : Tensor();
  const SgdCoefs c = sgd_coefs(o, step, scale);
  each_scalar(g, copy, [&](auto* gp, auto* cp, int64_t i) {
    kernels::sgd_at<Ops>(c, p.data_as<float>(), gp, b.data_as<float>(), cp, i);
  });
  for (int64_t i = 0; i < kN; ++i) {  // torch.optim's SGD in float64
    const double gi = double(at(g, i)) * scale + o.weight_decay * at(p0, i);
    const double bi = step == 1 ? gi : o.momentum * at(b0, i) + (1 - o.dampening) * gi;
    const double pi = at(p0, i) - o.lr * (nesterov ? gi + o.momentum * bi : bi);
    CHECK(close(at(p, i), pi, std::fabs(at(p0, i)) + o.lr * (std::fabs(gi) + std::fabs(bi))));
    CHECK(close(at(b, i), bi, std::fabs(at(b0, i)) + std::fabs(gi)));
    if (is_given(copy)) CHECK(at(copy, i) == to_dtype_and_back(copy.dtype(), at(p, i)));
  }
  for (Isa isa : supported_isas()) {
    set_cpu_isa(isa);
    Tensor pk = clone(p0), bk = clone(b0), ck = is_given(copy0) ? clone(copy0) : Tensor();
    sgd_update(o, step, scale, pk, g, bk, ck);
    CHECK(same_bits(pk, p) && same_bits(bk, b) && same_bits(ck, copy));
  }
}

}  // namespace

// Config(deterministic=True)'s exact sums: int64 adds into int64 exactly
// (values past float64's 53 bits included), fill zeroes them, and the float
// kernels and a float source refuse int64.
void check_int64() {
  Tensor dst = Tensor::empty({3}, DType::kInt64), src = Tensor::empty({3}, DType::kInt64);
  const int64_t big = (int64_t(1) << 61) + 1;  // not a float64
  const int64_t d0[] = {big, -7, 0}, s0[] = {big, 5, -(int64_t(1) << 62)};
  std::memcpy(dst.data(), d0, sizeof d0);
  std::memcpy(src.data(), s0, sizeof s0);
  accumulate(dst, src);
  CHECK(dst.data_as<int64_t>()[0] == 2 * big && dst.data_as<int64_t>()[1] == -2 &&
        dst.data_as<int64_t>()[2] == -(int64_t(1) << 62));
  fill(dst, 0.0f);
  CHECK(dst.data_as<int64_t>()[0] == 0 && dst.data_as<int64_t>()[2] == 0);
  bool refused = false;
  try {
    accumulate(dst, make(DType::kFloat32, {1.0f, 2.0f, 3.0f}));
  } catch (const TypeMismatch&) {
    refused = true;
  }
  CHECK(refused);
  refused = false;
  try {
    sum_of_squares({dst});
  } catch (const TypeMismatch&) {
    refused = true;
  }
  CHECK(refused);
}

int main() {
  check_int64();
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (DType gd : dtypes) {
    for (DType cd : dtypes) {
      // Copies are 16-bit; the float32 slot stands for "no copy".
      const Tensor copy0 = cd == DType::kFloat32 ? Tensor() : make(cd, random_values(0, 1));
      for (bool adamw : {true, false}) check_adam(gd, copy0, adamw);
      for (bool nesterov : {true, false}) {
        for (int64_t step : {1, 2}) check_sgd(gd, copy0, nesterov, step);
      }
      // Accumulate: float64 addition of two floats rounds to float exactly
      // as float addition does, then both cast the same way.
      const Tensor dst0 = make(gd, random_values(0, 1)), src = make(cd, random_values(0, 1));
      Tensor dst = clone(dst0);
      accumulate(dst, src);
      for (int64_t i = 0; i < kN; ++i) {
        CHECK(at(dst, i) == to_dtype_and_back(gd, float(double(at(dst0, i)) + double(at(src, i)))));
      }
    }
    const float value = std::normal_distribution<float>()(rng);
    Tensor filled = make(gd, random_values(0, 1));
    fill(filled, value);
    for (int64_t i = 0; i < kN; ++i) CHECK(at(filled, i) == to_dtype_and_back(gd, value));
    const Tensor x = make(gd, random_values(0, 1));
    double want = 0.0;
    for (int64_t i = 0; i < kN; ++i) want += double(at(x, i)) * double(at(x, i));
    CHECK(std::fabs(sum_of_squares({x}) - want) <= 1e-12 * want);
  }
  set_cpu_isa(supported_isas().back());
  return test::finish("test_element_math");
}
