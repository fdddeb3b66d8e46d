// A partition's runs as Python hands them over (zerocore._native.FlatRuns),
// converted from DLPack once: the optimizer bindings and the step's share them.
#pragma once
#include <nanobind/nanobind.h>

#include <vector>

#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/kernels/optim.h"

namespace zerocore::bindings {

// Each torch-style param group's options: a dict holding "lr",
// "weight_decay" and the algorithm's own keys (the engine passes its
// optimizer's param_groups as they are).
std::vector<AdamOptions> adam_groups(const nanobind::list& groups, bool adamw);
std::vector<SgdOptions> sgd_groups(const nanobind::list& groups);

struct FlatRuns {
  std::vector<FlatRun> runs;
  std::vector<Tensor> grads;
};

}  // namespace zerocore::bindings
