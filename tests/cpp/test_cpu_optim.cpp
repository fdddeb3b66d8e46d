// The CPU optimizers on every instruction set this machine runs: against a
// double-precision reference of torch.optim's Adam/AdamW, and bit for bit
// against each other (same operations, explicit FMAs).
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "zerocore/zerocore.h"

using namespace zerocore;

namespace {

struct Run {
  std::vector<float> p, m, v;
  std::vector<uint16_t> copy;
};

Run run_adam(Isa isa, const std::vector<float>& p0, const std::vector<std::vector<uint16_t>>& grads,
             const AdamOptions& o, double scale) {
  set_cpu_isa(isa);
  const int64_t n = int64_t(p0.size());
  Tensor p = Tensor::empty({n}, DType::kFloat32), m = Tensor::empty({n}, DType::kFloat32),
         v = Tensor::empty({n}, DType::kFloat32), copy = Tensor::empty({n}, DType::kBFloat16);
  std::memcpy(p.data(), p0.data(), p.nbytes());
  std::memset(m.data(), 0, m.nbytes());
  std::memset(v.data(), 0, v.nbytes());
  for (size_t s = 0; s < grads.size(); ++s) {
    Tensor g(const_cast<uint16_t*>(grads[s].data()), DType::kBFloat16, Device{}, {n}, nullptr);
    adam_update(o, int64_t(s + 1), scale, p, g, m, v, copy);
  }
  Run r;
  r.p.assign(p.data_as<float>(), p.data_as<float>() + n);
  r.m.assign(m.data_as<float>(), m.data_as<float>() + n);
  r.v.assign(v.data_as<float>(), v.data_as<float>() + n);
  r.copy.assign(copy.data_as<uint16_t>(), copy.data_as<uint16_t>() + n);
  return r;
}

// torch.optim.Adam(W) in double, written out.
std::vector<double> reference_adam(const std::vector<float>& p0, const std::vector<std::vector<uint16_t>>& grads,
                                   const AdamOptions& o, double scale) {
  std::vector<double> p(p0.begin(), p0.end()), m(p.size()), v(p.size());
  for (size_t s = 0; s < grads.size(); ++s) {
    const double step = double(s + 1);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = double(bf16_to_float(grads[s][i])) * scale;
      if (o.adamw) {
        p[i] *= 1.0 - o.lr * o.weight_decay;
      } else {
        g += o.weight_decay * p[i];
      }
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(o.beta2, step)) + o.eps;
      p[i] -= o.lr / (1 - std::pow(o.beta1, step)) * m[i] / denom;
    }
  }
  return p;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int64_t n : {1, 15, 16, 17, 1000, 65537}) {
    std::vector<float> p0(static_cast<size_t>(n));
    for (float& x : p0) x = normal(rng);
    std::vector<std::vector<uint16_t>> grads(12, std::vector<uint16_t>(size_t(n)));
    for (auto& g : grads) {
      for (auto& x : g) x = float_to_bf16(normal(rng));
    }
    for (bool adamw : {true, false}) {
      AdamOptions o;
      o.lr = 1e-2;
      o.weight_decay = 0.05;
      o.adamw = adamw;
      const std::vector<double> ref = reference_adam(p0, grads, o, 0.5);
      const auto isas = supported_isas();
      const Run base = run_adam(isas[0], p0, grads, o, 0.5);
      for (size_t i = 0; i < ref.size(); ++i) {
        CHECK(std::fabs(base.p[i] - ref[i]) <= 1e-6 + 1e-5 * std::fabs(ref[i]));
        CHECK(base.copy[i] == float_to_bf16(base.p[i]));
      }
      for (Isa isa : isas) {
        const Run r = run_adam(isa, p0, grads, o, 0.5);
        CHECK(std::memcmp(r.p.data(), base.p.data(), r.p.size() * 4) == 0);
        CHECK(std::memcmp(r.m.data(), base.m.data(), r.m.size() * 4) == 0);
        CHECK(std::memcmp(r.v.data(), base.v.data(), r.v.size() * 4) == 0);
        CHECK(r.copy == base.copy);
      }
    }
  }
  set_cpu_isa(supported_isas().back());
  // A rejected call throws the documented type and writes nothing.
  Tensor p = Tensor::empty({4}, DType::kFloat32), g16 = Tensor::empty({4}, DType::kFloat16);
  std::memset(p.data(), 0, p.nbytes());
  bool type_error = false, size_error = false;
  try {
    adam_update(AdamOptions{}, 1, 1.0, p, g16, p, g16, Tensor());
  } catch (const TypeMismatch&) {
    type_error = true;
  }
  try {
    adam_update(AdamOptions{}, 1, 1.0, p, g16, p, Tensor::empty({3}, DType::kFloat32), Tensor());
  } catch (const InvalidArgument&) {
    size_error = true;
  }
  CHECK(type_error && size_error);
  CHECK(p.data_as<float>()[0] == 0.0f);
  return test::finish("test_cpu_optim");
}
