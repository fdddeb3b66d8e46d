// The keys of the control plane's collectives (agreements, the step's
// exchange, stage 3's rounds, broadcasts of buffers): group kControlGroup,
// which the queue neither fingerprints nor counts, and in the bucket what
// the collective is for, so that an error names it (python/zerocore/comm/communicator.py
// reads the same values through the bindings).
#pragma once
#include <cstdint>

#include "zerocore/comm/comm.h"

namespace zerocore {

constexpr int32_t kControlGroup = -1;

enum class ControlPurpose : int32_t {
  kRound = 0,       // stage 3's rounds (round_protocol.cpp), on a group of their own
  kNorms = 1,       // the step's one exchange (zero_step.cpp)
  kAgreement = 2,   // the ranks' agreements at wrap, load or save (Python)
  kBroadcasts = 3,  // a broadcast of buffers or params (Python)
  kMicroBatches = 4,  // the ranks' places in their step, before a micro-batch's collectives and at the step (Python)
  kExactGrads = 5,  // Config(deterministic=True): the grads' grid and integer sums at the step (Python)
};

inline CollectiveKey control_key(CollectiveKind kind, ControlPurpose purpose, int64_t numel) {
  return CollectiveKey{kind, kControlGroup, int32_t(purpose), numel};
}

}  // namespace zerocore
