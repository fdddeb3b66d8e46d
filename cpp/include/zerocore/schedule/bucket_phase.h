// Where one bucket of gradient reduction is in a backward, and the one
// place that changes it. It was two flags (issued, and a staging slot held
// or not) whose four combinations the reducer kept consistent by hand; as
// one enum a bucket's phase is one value, and every change goes through
// advance(), which throws a std::logic_error naming the bucket and the step
// when the reducer takes one it never should (a bug in the reducer, caught
// where it happens rather than as a wrong grad later), as unit_state.h does
// for stage 3's units.
#pragma once
#include <string>

namespace zerocore {

enum class BucketPhase {
  kEmpty,    // not issued this backward, no staging: no grad of it staged yet
  kStaging,  // not issued, grads staged in its staging slot (or its views handed out)
  kIssued,   // its reduce-scatter issued (or skipped) this backward; no staging
  kLate,     // issued, and grads came after it: staged again, reduced once the ranks agree on it
};

const char* phase_name(BucketPhase p);
inline bool issued(BucketPhase p) { return p == BucketPhase::kIssued || p == BucketPhase::kLate; }
inline bool holds_staging(BucketPhase p) { return p == BucketPhase::kStaging || p == BucketPhase::kLate; }

// Moves the bucket's `phase` to `to`; `bucket` names it in the error. The
// steps taken:
//   empty -> staging (a grad or its views take staging), staging -> issued
//   (its reduce-scatter), empty -> issued and staging -> late (skipped: its
//   group's unit ran on no rank), issued -> late (a grad after the issue),
//   issued -> empty and late -> staging (the backward ended: late grads are
//   carried to the next reduction), staging -> empty and late -> issued
//   (staged grads dropped).
// Any other step throws std::logic_error.
void advance(const std::string& bucket, BucketPhase& phase, BucketPhase to);

}  // namespace zerocore
