// The step's collectives over whole flat buffers, bucket by bucket, in
// place: stages 0-1 reduce the grads accumulated over the step (all-reduce,
// or reduce-scatter into each rank's blocks), stages 1-2 all-gather the
// updated params into every rank's full buffer. One collective per bucket,
// issued in the flat groups' order and then plan order on the queue, all
// in flight together; run() waits for the last.
#pragma once
#include <cstdint>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/flat_group_buffer.h"

namespace zerocore {

class BucketCollectives {
 public:
  // kind: kAllReduce, kReduceScatter or kAllGather. buffers: whole flat
  // buffers (plan.total_elems() elements).
  BucketCollectives(CommQueue& comm, CollectiveKind kind, std::vector<FlatGroupBuffer> buffers);
  void run();

 private:
  CommQueue& comm_;
  CollectiveKind kind_;
  std::vector<FlatGroupBuffer> buffers_;
};

}  // namespace zerocore
