#include "zerocore/schedule/param_bindings.h"

#include <algorithm>

namespace zerocore {

std::vector<int> ParamBindings::take_released() {
  std::vector<int> released;
  for (int u = 0; u < pool_.num_units(); ++u) {
    const void*& bound = bound_[size_t(u)];
    if (bound != nullptr && bound != pool_.buffer(u).data()) {
      released.push_back(u);
      bound = nullptr;
    }
  }
  return released;
}

ParamBinding ParamBindings::bind(int unit) {
  const Tensor& buffer = pool_.buffer(unit);
  ParamBinding b{buffer, bound_[size_t(unit)] != buffer.data(), take_released()};
  bound_[size_t(unit)] = buffer.data();
  return b;
}

void ParamBindings::unbind_all() { std::fill(bound_.begin(), bound_.end(), nullptr); }

}  // namespace zerocore
