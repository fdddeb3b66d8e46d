#include "zerocore/schedule/unit_state.h"

#include <stdexcept>
#include <string>

namespace zerocore {

const char* state_name(Residency r) {
  switch (r) {
    case Residency::kReleased: return "released";
    case Residency::kGathering: return "gathering";
    case Residency::kGathered: return "gathered";
    case Residency::kHeld: return "held";
  }
  return "?";
}

const char* state_name(Grads g) {
  switch (g) {
    case Grads::kNone: return "none";
    case Grads::kComing: return "coming";
    case Grads::kReduced: return "reduced";
  }
  return "?";
}

namespace {

bool allowed(Residency from, Residency to) {
  using R = Residency;
  switch (to) {
    case R::kGathering: return from == R::kReleased;
    case R::kGathered: return from == R::kGathering || from == R::kHeld;
    case R::kHeld: return from == R::kGathered;
    case R::kReleased: return from == R::kGathered || from == R::kHeld;
  }
  return false;
}

bool allowed(Grads from, Grads to) {
  switch (to) {
    case Grads::kComing: return from == Grads::kNone;
    case Grads::kReduced: return from != Grads::kReduced;
    case Grads::kNone: return from == Grads::kReduced;
  }
  return false;
}

template <class State>
void step(int unit, State& state, State to, const char* what) {
  if (!allowed(state, to)) {
    throw std::logic_error("UnitSchedule: unit " + std::to_string(unit) + "'s " + what + " went from " +
                           state_name(state) + " to " + state_name(to) +
                           ", a step the schedule never takes (a bug in the schedule: please report it)");
  }
  state = to;
}

}  // namespace

void advance(int unit, Residency& state, Residency to) { step(unit, state, to, "params"); }
void advance(int unit, Grads& state, Grads to) { step(unit, state, to, "grads"); }

}  // namespace zerocore
