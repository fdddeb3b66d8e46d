// Loss scaling for fp16: the loss is multiplied by the scale before
// backward and the step divides it out of the grads (ZeroStep's grad scale).
//
// A fixed scale stays as it is. Dynamic scaling: a step whose grads are not
// finite on any rank is skipped on every rank, and once `hysteresis` such
// overflows came without a scale increase between them the scale halves,
// never below min_scale (an overflow there throws: the grads are not finite
// at any scale, and skipping every step would train nothing without a
// word); after `window` clean steps it doubles (deepspeed_growth: DeepSpeed's
// rule, which waits one clean step more before the first doubling after an
// overflow or the start; consecutive_hysteresis: a clean step restores the
// hysteresis). DeepSpeed's DynamicLossScaler is the reference
// (tests/test_deepspeed_config.py checks the two step by step).
#pragma once
#include <cstdint>
#include <stdexcept>

namespace zerocore {

// The grads hold inf/NaN and nothing absorbs it (no dynamic scaling, or the
// scale at its minimum): thrown on every rank, with nothing updated.
class NonFiniteGradients : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct DynamicScale {
  double initial = 65536.0;
  int64_t window = 2000;
  int64_t hysteresis = 1;
  double min_scale = 1.0;
  bool consecutive_hysteresis = false;
  bool deepspeed_growth = false;
};

class LossScaler {
 public:
  // What a checkpoint keeps.
  struct State {
    double scale = 1.0;
    int64_t clean_steps = 0;  // steps without overflow since the last one (or the start)
    int64_t hysteresis = 1;   // overflows left before the next halving
  };

  explicit LossScaler(double fixed = 1.0);  // a fixed scale (1: none)
  explicit LossScaler(const DynamicScale& policy);

  bool dynamic() const { return dynamic_; }
  double scale() const { return state_.scale; }
  // Records one step's outcome: with dynamic scaling, adjusts the scale;
  // throws NonFiniteGradients on an overflow at the minimum scale. A fixed
  // scale ignores it (the step decides what a non-finite grad means then).
  void update(bool overflow);

  const State& state() const { return state_; }
  // A checkpoint's state; a fixed scale keeps its own (it is a setting).
  void load(const State& state);

 private:
  bool dynamic_ = false;
  DynamicScale policy_;
  State state_;
};

}  // namespace zerocore
