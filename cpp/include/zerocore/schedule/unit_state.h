// The two states stage 3 keeps per unit, and the one place each changes.
// Where a unit's params are (Residency) is the gather pool's; what its
// grads are in this step's backward (Grads) is the schedule's. Each was a
// handful of flags whose combinations the code had to keep consistent by
// hand (a buffer with no slot, held but released, reduced and still
// expected); as one enum each, a state is one value, and every change goes
// through advance(), which throws a std::logic_error naming the unit and
// the step when the schedule takes one it never should: a bug in the
// schedule, caught where it happens rather than as a wrong gather later.
#pragma once

namespace zerocore {

// Where a unit's params are on this rank.
enum class Residency {
  kReleased,   // nowhere: its params view no memory
  kGathering,  // its gather is issued into its buffer; compute is not yet ordered after it
  kGathered,   // in its buffer, compute ordered after the gather, no hook uses it (a prefetch; the root between passes)
  kHeld,       // a hook uses it: not evicted, not released by release_all
};

// A unit's grads in this step's backward, as this rank knows them.
enum class Grads {
  kNone,     // no call of it produces grads (yet)
  kComing,   // a call of it produces grads: reported as run in the rounds
  kReduced,  // the ranks agreed they are complete and reduced them (or skipped them where no rank ran it)
};

const char* state_name(Residency r);
const char* state_name(Grads g);

// Moves unit's `state` to `to`. The steps taken:
//   Residency: released -> gathering (a gather issued into its buffer),
//     gathering -> gathered (compute waits for the gather), gathered -> held
//     (a hook uses it), held -> gathered (no hook uses it any more, it stays),
//     gathered or held -> released (its buffer goes back).
//   Grads: none -> coming (a call produces grads), none or coming -> reduced
//     (the round that agrees on it), reduced -> none (the backward ended).
// Any other step throws std::logic_error.
void advance(int unit, Residency& state, Residency to);
void advance(int unit, Grads& state, Grads to);

}  // namespace zerocore
