// The native core of a ZeRO engine: its gradient reduction, stage 3's unit
// schedule, the step's collectives, the offloaded host update and the step
// itself (ZeroStep), built in one place from what the engine already has:
// its flat groups' partition stores, its units and its placement (the
// stage, and the host optimizer when offloaded). The core owns them and
// connects them (the reducer to the schedule's rounds and to the step's
// exchange), so the Python engine (python/zerocore/engine.py) and a C++
// embedder (cpp/examples/embed_zero.cpp) hold one object and wire nothing.
//
// What is built, per stage:
//
//   part          stages  from
//   grad_reduce   0-1     every trainable group's grad_full (all-reduce at
//                         stage 0, reduce-scatter at stage 1), run by the step
//   reducer       2-3     every trainable group's grad_part, in the
//                         reduction order; at stage 3 it issues on request
//   schedule      3       every unit's groups' shards; its rounds reduce the
//                         unit's trainable groups
//   param_gather  1-3     every trainable group kept whole: its full params,
//                         all-gathered after the update (at stage 3 the
//                         groups under the persist threshold)
//   host_update   1-3     offloaded: over the caller's OffloadOptimizer
//   step          0-3     the stores' runs (not offloaded), and the above
//
// The offload swap (a delayed update's host grads trading places with the
// buffer reduction fills) is one native operation here: follow_swaps()
// swaps the stores' buffers, and the reducer adds into the new ones from
// the next backward on (before_backward).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/offload/offload_optimizer.h"
#include "zerocore/schedule/bucket_collectives.h"
#include "zerocore/schedule/bucket_reducer.h"
#include "zerocore/schedule/unit_schedule.h"
#include "zerocore/step/host_update.h"
#include "zerocore/step/loss_scaler.h"
#include "zerocore/step/zero_step.h"
#include "zerocore/store/partition_store.h"
#include "zerocore/tensor.h"

namespace zerocore {

class EngineCore {
 public:
  // The queues the parts issue on; each must outlive the core.
  struct Queues {
    CommQueue* data = nullptr;        // the data collectives (gathers, stages 0-1's reduction)
    CommQueue* control = nullptr;     // the step's exchange (a host process group beside the data one)
    CommQueue* reductions = nullptr;  // stages 2-3's reducer, where it is not `data` (nullptr: data)
    CommQueue* rounds = nullptr;      // stage 3's rounds (and with them the step's exchange may share it)
  };
  // A flat group: its store (allocated, outliving the core) and its tag,
  // its key in every collective (the same on every rank).
  struct Group {
    PartitionStore* store = nullptr;
    int32_t tag = 0;
    // Config(deterministic=True): where reduction adds this group's grads
    // in place of its store's grad buffer (int64 sums, as many elements);
    // undefined: the store's. All trainable groups or none.
    Tensor reduced;
  };
  // Stage 3: a unit, gathered and released as one.
  struct Unit {  // the first is the root, whose backward ends last
    std::vector<int> groups;  // indices into Description::groups, in the unit's buffer order
    bool own_slot = false;    // kept gathered in a slot of its own (the root unit)
  };
  // A place of the reduction order: the group reduced there, under a tag.
  struct Reduced {
    int group = 0;  // an index into Description::groups
    int32_t tag = 0;
  };
  struct Description {
    Queues queues;
    std::vector<Group> groups;
    std::vector<Unit> units;  // stage 3; none at stages 0-2
    int stage = 0;            // ZeRO's: 0-3
    // ZeRO-Offload (stages 1-3): the host optimizer over the stores' host
    // runs (it must outlive the core); nullptr: the step updates the runs
    // where training runs.
    OffloadOptimizer* offload = nullptr;
    std::optional<int64_t> delays_from;  // offloaded: the first step whose update is delayed
    LossScaler* loss_scaler = nullptr;   // must outlive the core; nullptr: none
    // Stages 2-3: the reducer's staging slots; none: as the core plans
    // them from the layout and the units (engine_core.cpp, staging_for).
    std::optional<int> staging_buffers;
    int64_t prefetch_bytes = 1;          // stage 3: the units gathered ahead of use
    // Test only: the reduction order (stages 2-3), to check that ranks which
    // reduce differently are caught; empty: the trainable groups in
    // Description order, each under its own tag.
    std::vector<Reduced> reduction_order;
  };

  // Checks the description (InvalidArgument naming what is wrong: the
  // stage, a missing queue, a group whose store was placed for another
  // stage or world size or is not allocated, groups of different reduce
  // dtypes, a unit naming a group that is not there or is not sharded,
  // units of different dtypes, a sharded group in no unit, a reduction
  // order that does not name each trainable group once) and builds the
  // parts.
  explicit EngineCore(const Description& description);
  ~EngineCore();  // the step first, then the parts it drives
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  int stage() const { return stage_; }
  ZeroStep& zero_step() { return *step_; }
  // The parts, nullptr where the stage has none (table above). The reducer
  // changes with set_reduction_order.
  BucketCollectives* grad_reduce() { return grad_reduce_.get(); }
  BucketCollectives* param_gather() { return param_gather_.get(); }
  BucketReducer* reducer() { return reducer_.get(); }
  UnitSchedule* schedule() { return schedule_.get(); }
  HostUpdate* host_update() { return host_update_.get(); }

  // The step's exchange and the step (ZeroStep), the offload swap followed.
  const Exchanged& exchange(int64_t changes = 0);
  StepResult step(const StepOptions& options);
  // Follows the swaps the host update made since the last call (a delayed
  // update's host grads trade places with the buffer reduction fills, in
  // the step's exchange): the stores swap their buffers now, the reducer
  // adds into the new ones from before_backward on. Returns how many it
  // followed (a caller with views of the buffers follows them as many
  // times). exchange() and step() call it themselves.
  int64_t follow_swaps();
  // Before a backward: the reducer adds into the grad buffers now in the
  // stores (after a swap).
  void before_backward();

  // Test only: reduce in `order` from now on (see Description): the reducer
  // is rebuilt and the step and the schedule use it. Stage 3's rounds keep
  // reducing each unit's places of the order, so another order here makes
  // them reduce other groups than the peers'.
  void set_reduction_order(std::vector<Reduced> order);

 private:
  void check(const Description& d) const;
  void build_reducer();
  // The stores' buffers reduction adds into, in the reduction order.
  std::vector<Tensor> grad_partitions() const;

  const Description description_;  // as built (the reduction order aside)
  int stage_;
  std::vector<Reduced> order_;
  std::vector<std::vector<int>> unit_places_;  // stage 3: per unit, its trainable groups' places in the order
  int staging_buffers_ = 0;                     // stages 2-3: the reducer's
  DType reduce_dtype_ = DType::kFloat32;
  bool exact_ = false;  // the groups' grads are reduced into `reduced`
  int64_t swaps_followed_ = 0;
  bool partitions_stale_ = false;  // swapped since the reducer's partitions were set

  std::unique_ptr<BucketCollectives> grad_reduce_;
  std::unique_ptr<BucketCollectives> param_gather_;
  std::unique_ptr<BucketReducer> reducer_;
  std::unique_ptr<UnitSchedule> schedule_;
  std::unique_ptr<HostUpdate> host_update_;
  std::unique_ptr<ZeroStep> step_;
};

}  // namespace zerocore
