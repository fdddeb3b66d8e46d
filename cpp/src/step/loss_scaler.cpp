#include "zerocore/step/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

namespace {

bool positive(double x) { return std::isfinite(x) && x > 0.0; }

}  // namespace

LossScaler::LossScaler(double fixed) {
  if (!positive(fixed)) throw InvalidArgument("LossScaler: a fixed scale must be positive and finite");
  state_.scale = fixed;
}

LossScaler::LossScaler(const DynamicScale& policy) : dynamic_(true), policy_(policy) {
  if (!positive(policy.initial) || !positive(policy.min_scale) || policy.min_scale > policy.initial ||
      policy.window < 1 || policy.hysteresis < 1) {
    throw InvalidArgument("LossScaler: a dynamic scale needs 0 < min_scale <= initial, window >= 1 and "
                          "hysteresis >= 1");
  }
  state_ = State{policy.initial, 0, policy.hysteresis};
}

void LossScaler::update(bool overflow) {
  if (!dynamic_) return;
  if (overflow) {
    state_.clean_steps = 0;
    if (state_.hysteresis > 1) {
      --state_.hysteresis;
      return;
    }
    if (state_.scale <= policy_.min_scale) {
      std::ostringstream min;
      min << policy_.min_scale;
      throw NonFiniteGradients(
          "zerocore: fp16 gradients overflowed (inf/NaN) with the loss scale at its minimum (" + min.str() +
          "); they are not finite at any scale (a NaN or inf loss?), and skipping every step would train "
          "nothing. The step was skipped on every rank.");
    }
    state_.scale = std::max(state_.scale / 2.0, policy_.min_scale);
    return;
  }
  ++state_.clean_steps;
  if (policy_.consecutive_hysteresis) state_.hysteresis = policy_.hysteresis;
  const int64_t stable = state_.clean_steps - (policy_.deepspeed_growth ? 1 : 0);
  if (stable > 0 && stable % policy_.window == 0) {
    state_.scale *= 2.0;
    state_.hysteresis = policy_.hysteresis;
  }
}

void LossScaler::load(const State& state) {
  if (!positive(state.scale) || state.clean_steps < 0 || state.hysteresis < 1) {
    throw InvalidArgument("LossScaler.load: the scale must be positive and finite, clean_steps >= 0 and "
                          "hysteresis >= 1");
  }
  // A fixed scale is the caller's setting, not state: a checkpoint of a
  // dynamically scaled run (fp16) resumed without scaling (bf16) must not
  // divide unscaled grads by the scale it saved.
  if (dynamic_) state_ = state;
}

}  // namespace zerocore
