#include "zerocore/kernels/optim_args.h"

#include <string>

#include "zerocore/error.h"

namespace zerocore {

namespace {

std::string device_str(Device d) {
  return (d.type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(d.index));
}

void check_tensor(const char* op, const char* name, const Tensor& t, Device device, int64_t numel,
                  bool float32_only) {
  const std::string where = std::string(op) + ": " + name;
  if (!is_given(t)) throw InvalidArgument(where + " is required");
  if (t.device() != device) {
    throw TypeMismatch(where + " is on " + device_str(t.device()) + ", expected " + device_str(device));
  }
  if (float32_only && t.dtype() != DType::kFloat32) {
    throw TypeMismatch(where + " must be float32, got " + dtype_name(t.dtype()));
  }
  if (t.numel() != numel) {
    throw InvalidArgument(where + " has " + std::to_string(t.numel()) + " elements but param has " +
                          std::to_string(numel));
  }
}

// The param group of run i, checked against the number of param groups given.
size_t group_of(const char* op, size_t groups, const std::vector<FlatRun>& runs, size_t i) {
  const int g = runs[i].param_group;
  if (g < 0 || size_t(g) >= groups) {
    throw InvalidArgument(std::string(op) + ": run " + std::to_string(i) + " belongs to param group " +
                          std::to_string(g) + " but options were given for " + std::to_string(groups) +
                          " param group(s)");
  }
  return size_t(g);
}

std::string run_op(const char* op, const std::vector<FlatRun>& runs, size_t i) {
  return runs.size() == 1 ? std::string(op) : std::string(op) + " (run " + std::to_string(i) + ")";
}

}  // namespace

void check_flat_update(const char* op, Device device, const Tensor& param, const Tensor& grad,
                       std::initializer_list<NamedTensor> state, const Tensor& param_copy) {
  check_tensor(op, "param", param, device, param.numel(), true);
  check_tensor(op, "grad", grad, device, param.numel(), false);
  for (const auto& s : state) check_tensor(op, s.name, *s.tensor, device, param.numel(), true);
  if (is_given(param_copy)) {
    check_tensor(op, "param_copy", param_copy, device, param.numel(), false);
    if (param_copy.dtype() == DType::kFloat32) {
      throw TypeMismatch(std::string(op) + ": param_copy must be bfloat16 or float16, got float32");
    }
  }
}

void check_adam_runs(Device device, size_t groups, const std::vector<FlatRun>& runs) {
  for (size_t i = 0; i < runs.size(); ++i) {
    group_of("adam_", groups, runs, i);
    const FlatRun& r = runs[i];
    check_flat_update(run_op("adam_", runs, i).c_str(), device, r.param, r.grad,
                      {{"exp_avg", &r.state0}, {"exp_avg_sq", &r.state1}}, r.param_copy);
  }
}

void check_sgd_runs(Device device, const std::vector<SgdOptions>& groups, const std::vector<FlatRun>& runs) {
  for (size_t i = 0; i < runs.size(); ++i) {
    const FlatRun& r = runs[i];
    const std::string op = run_op("sgd_", runs, i);
    if (groups[group_of("sgd_", groups.size(), runs, i)].momentum != 0.0) {
      check_flat_update(op.c_str(), device, r.param, r.grad, {{"momentum_buffer", &r.state0}}, r.param_copy);
    } else {
      check_flat_update(op.c_str(), device, r.param, r.grad, {}, r.param_copy);
    }
  }
}

}  // namespace zerocore
