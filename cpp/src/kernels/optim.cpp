#include "zerocore/kernels/optim.h"

#include <cmath>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

namespace {

void check_range(const char* op, const char* name, double value, double lo, double hi, bool hi_open) {
  if (!(value >= lo && (hi_open ? value < hi : value <= hi))) {
    throw InvalidArgument(std::string(op) + ": " + name + "=" + std::to_string(value) + " is outside [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + (hi_open ? ")" : "]"));
  }
}

void check_common(const char* op, int64_t step, double lr, double weight_decay, double grad_scale) {
  if (step < 1) throw InvalidArgument(std::string(op) + ": step must be >= 1 (the first update is step 1)");
  check_range(op, "lr", lr, 0.0, HUGE_VAL, false);
  check_range(op, "weight_decay", weight_decay, 0.0, HUGE_VAL, false);
  if (!std::isfinite(grad_scale)) throw InvalidArgument(std::string(op) + ": grad_scale must be finite");
}

}  // namespace

AdamCoefs adam_coefs(const AdamOptions& o, int64_t step, double grad_scale) {
  const char* op = "adam_";
  check_common(op, step, o.lr, o.weight_decay, grad_scale);
  check_range(op, "beta1", o.beta1, 0.0, 1.0, true);
  check_range(op, "beta2", o.beta2, 0.0, 1.0, true);
  check_range(op, "eps", o.eps, 0.0, HUGE_VAL, false);
  const double bias1 = 1.0 - std::pow(o.beta1, double(step));
  const double bias2 = 1.0 - std::pow(o.beta2, double(step));
  return AdamCoefs{float(grad_scale),
                   float(o.adamw ? 0.0 : o.weight_decay),
                   float(o.adamw ? 1.0 - o.lr * o.weight_decay : 1.0),
                   float(o.beta1),
                   float(1.0 - o.beta1),
                   float(o.beta2),
                   float(1.0 - o.beta2),
                   float(-o.lr / bias1),
                   float(1.0 / std::sqrt(bias2)),
                   float(o.eps)};
}

SgdCoefs sgd_coefs(const SgdOptions& o, int64_t step, double grad_scale) {
  const char* op = "sgd_";
  check_common(op, step, o.lr, o.weight_decay, grad_scale);
  check_range(op, "momentum", o.momentum, 0.0, HUGE_VAL, false);
  check_range(op, "dampening", o.dampening, 0.0, 1.0, false);
  const bool use_momentum = o.momentum != 0.0;
  if (o.nesterov && (!use_momentum || o.dampening != 0.0)) {
    throw InvalidArgument("sgd_: nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)");
  }
  return SgdCoefs{float(grad_scale), float(o.weight_decay), float(o.momentum), float(1.0 - o.dampening),
                  float(-o.lr),      use_momentum,          step == 1,         o.nesterov};
}

}  // namespace zerocore
