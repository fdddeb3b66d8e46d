// One buffer of a flat group (the params that share one LayoutPlan) with
// what a collective over it needs: the group's layout and its tag, the
// collectives' key. Stage 3's unit schedule gathers units from their flat
// groups' shards, the bucket reducer adds into their grad partitions and
// the step's bucket collectives move their whole flat buffers: each takes
// a list of these. A PartitionStore hands them out for its buffers
// (PartitionStore::group_buffer).
#pragma once
#include <cstdint>

#include "zerocore/layout.h"
#include "zerocore/tensor.h"

namespace zerocore {

struct FlatGroupBuffer {
  int32_t tag = 0;  // the flat group's key in every collective over it (CollectiveKey::group): the same on every rank
  LayoutPlan plan;
  // Whole (plan.total_elems() elements) or this rank's partition
  // (plan.partition_elems()), as the taker says.
  Tensor buffer;
};

}  // namespace zerocore
