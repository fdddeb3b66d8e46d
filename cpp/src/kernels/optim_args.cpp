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

}  // namespace zerocore
