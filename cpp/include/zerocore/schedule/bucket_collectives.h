// The step's collectives over whole flat buffers, bucket by bucket, in
// place: stages 0-1 reduce the grads accumulated over the step (all-reduce,
// or reduce-scatter into each rank's blocks), stages 1-2 all-gather the
// updated params into every rank's full buffer. One collective per bucket,
// issued in the groups' order and then plan order on the group's queue, all
// in flight together; run() waits for the last.
#pragma once
#include <cstdint>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/layout.h"
#include "zerocore/tensor.h"

namespace zerocore {

struct FlatBuffer {
  int32_t tag = 0;  // the collectives' key: the same on every rank
  LayoutPlan plan;
  Tensor flat;      // plan.total_elems() elements
};

class BucketCollectives {
 public:
  // kind: kAllReduce, kReduceScatter or kAllGather.
  BucketCollectives(CommQueue& comm, CollectiveKind kind, std::vector<FlatBuffer> buffers);
  void run();

 private:
  CommQueue& comm_;
  CollectiveKind kind_;
  std::vector<FlatBuffer> buffers_;
};

}  // namespace zerocore
