#include "zerocore/schedule/bucket_phase.h"

#include <stdexcept>
#include <string>

namespace zerocore {

const char* phase_name(BucketPhase p) {
  switch (p) {
    case BucketPhase::kEmpty: return "empty";
    case BucketPhase::kStaging: return "staging";
    case BucketPhase::kIssued: return "issued";
    case BucketPhase::kLate: return "late";
  }
  return "?";
}

namespace {

bool allowed(BucketPhase from, BucketPhase to) {
  using P = BucketPhase;
  switch (to) {
    case P::kStaging: return from == P::kEmpty || from == P::kLate;
    case P::kIssued: return from == P::kStaging || from == P::kEmpty || from == P::kLate;
    case P::kLate: return from == P::kIssued || from == P::kStaging;
    case P::kEmpty: return from == P::kIssued || from == P::kStaging;
  }
  return false;
}

}  // namespace

void advance(const std::string& bucket, BucketPhase& phase, BucketPhase to) {
  if (!allowed(phase, to)) {
    throw std::logic_error("BucketReducer: " + bucket + " went from " + phase_name(phase) + " to " + phase_name(to) +
                           ", a step the reducer never takes (a bug in the reducer: please report it)");
  }
  phase = to;
}

}  // namespace zerocore
