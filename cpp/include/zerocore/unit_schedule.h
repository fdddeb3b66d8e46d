// Stage 3's schedule of units: where each unit's params are gathered, when
// their all-gathers are issued, when the memory goes back to the pool and
// when a unit's grads are ready to be reduced. The module's hooks tell it
// what this rank did (a unit is about to run forward, its forward ended, its
// backward begins, its post-backward point); it decides the rest.
//
// Ranks may run different units (experts chosen by the data), a different
// number of times, so no decision that needs a collective is taken alone:
// the ranks agree on it in a *round*. Each unit hook that needs params (a
// pre-forward, a pre-backward) runs one round: one small control all-reduce
// in which every rank says, per unit, whether it needs it now, holds it,
// finished with it since the last round, still expects its backward, and
// produced grads for it. From the sums every rank takes the same decisions,
// in the same order:
//   1. release the gathered units that some rank finished and none holds or
//      needs;
//   2. gather every unit some rank needs, in unit order (the union);
//   3. prefetch along the previous step's agreed order (backward: this
//      step's, reversed) from the furthest unit needed;
//   4. in backward, hand every unit that no rank expects a backward of any
//      more to grads_final, in reduction order (last unit first, the root
//      last): its grads, zeros from the ranks that did not run it, can be
//      reduce-scattered.
// So the set of gathered units, and every collective issued, is the same on
// every rank. A rank that has finished its forward or backward keeps
// answering rounds (end_forward, end_backward) until every rank has, as
// torch's Join does for uneven inputs; the last round releases everything
// and, after a backward, hands every unit not yet final to grads_final.
// When every rank runs the same units in the same order, a round costs one
// all-reduce of a few floats per unit per pass.
//
// A unit is gathered into a slot of a fixed pool sized by the largest unit:
// one slot for the unit in use plus the prefetch window. A unit marked
// own_slot (the root, which stays gathered across the whole forward and
// backward of a typical model) has a buffer of its own. When the units some
// ranks need at once do not fit, an unused prefetch is evicted, then the
// pool grows (once: a slot is kept).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include "zerocore/comm.h"
#include "zerocore/layout.h"
#include "zerocore/slot_pool.h"
#include "zerocore/tensor.h"

namespace zerocore {

// One flat group of a unit, as this rank holds it.
struct UnitGroup {
  int32_t tag = 0;  // the collectives' key: the same on every rank
  LayoutPlan plan;
  Tensor shard;     // this rank's partition: plan.partition_elems() elements
};

struct UnitSpec {
  std::vector<UnitGroup> groups;  // laid out one after another in the unit's buffer
  bool own_slot = false;
};

// Another rank reported a failure in a round (its forward or backward
// raised); thrown on every other rank at the same round, so none waits.
class PeerFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class UnitSchedule {
 public:
  // Called in a round, on every rank alike, once per unit and backward:
  // the unit's grads are complete on every rank. `reduce` is false when no
  // rank produced any (nothing to reduce).
  using GradsFinal = std::function<void(int unit, bool reduce)>;

  // prefetch_bytes: the budget of units gathered ahead of use; the next unit
  // is always prefetched when it is > 0.
  UnitSchedule(CommQueue& comm, std::vector<UnitSpec> units, DType dtype, int64_t prefetch_bytes,
               GradsFinal grads_final = {});
  ~UnitSchedule();  // waits for gathers in flight
  UnitSchedule(const UnitSchedule&) = delete;
  UnitSchedule& operator=(const UnitSchedule&) = delete;

  // The hooks. pre_forward and pre_backward run a round and return the
  // buffer the unit is gathered in (valid until its post hook).
  // marks_post_backward: post_backward(unit) will be called once this
  // forward's backward has gone through the unit (its inputs need grad).
  Tensor pre_forward(int unit, bool marks_post_backward);
  // backward_follows: the unit's outputs need grad (it produces grads).
  void post_forward(int unit, bool backward_follows);
  void begin_backward();
  Tensor pre_backward(int unit);
  void post_backward(int unit);
  // Rounds until every rank has ended its forward (backward), then releases
  // every unit (and hands every unit not yet final to grads_final). A rank
  // whose pass raised says `failed`: every other rank then throws
  // PeerFailed at the same round. end_forward does nothing when no forward
  // is open (it was ended already).
  void end_forward(bool failed = false);
  void end_backward(bool failed = false);
  void end_step();  // this step's agreed forward order guides the next step's prefetch

  // The unit's full flat params into `out` (unit_elems(unit) elements),
  // outside the pool and uncounted: for whole-model views.
  void gather_into(int unit, const Tensor& out);

  int num_units() const { return int(units_.size()); }
  // Elements of the unit's buffer, and where group g starts in it.
  int64_t unit_elems(int unit) const;
  int64_t group_offset(int unit, int group) const;
  // The buffer the unit is gathered (or being gathered) in; undefined when released.
  Tensor buffer(int unit) const;
  bool gathered(int unit) const { return buffer(unit).data() != nullptr; }
  // Bytes of every gather buffer: the pool and the units' own buffers.
  size_t buffer_bytes() const;
  int pool_slots() const { return pool_.size(); }
  // Rounds since construction, and the seconds spent in their all-reduces:
  // what agreeing costs.
  int64_t rounds() const { return rounds_; }
  double round_seconds() const { return round_seconds_; }

 private:
  // What this rank tells a round about one unit, one float each.
  enum Flag { kNeed, kHeld, kFinished, kExpects, kRan, kFlags };

  struct State {
    // Agreed: the same on every rank.
    int slot = -1;      // pool slot; -1 for none (or the own buffer)
    Tensor buffer;      // where it is gathered; undefined when released
    std::vector<std::shared_ptr<Event>> pending;
    bool final = false; // handed to grads_final in this backward
    // This rank's.
    bool held = false;  // a hook uses it (not merely prefetched)
    bool finished = false;  // held and let go since the last round
    int open_backwards = 0;
    int marked = 0;           // post_backward calls still to come
    bool unbounded = false;   // produces grads, with no post-backward point: open until the end
    bool ran = false;         // produced grads in this backward
    std::vector<bool> marks;  // per forward call in progress: whether it marked
  };
  struct Sums {  // a round's result: every rank's flags, summed
    std::vector<float> flags;
    float done = 0, failed = 0;
    float at(int unit, Flag f) const { return flags[size_t(unit) * kFlags + f]; }
  };

  // One round: every rank's flags summed, then the agreed decisions.
  Sums round(int need, bool done, bool failed);
  void release_finished(const Sums& sums);
  void prefetch(const Sums& sums);
  void finalize_grads(const Sums& sums, bool all);
  // Rounds until every rank is done; the last releases every unit.
  void join(bool failed, bool backward);
  void reset_after_failure(bool failed_here);

  // Starts the unit's gather unless it is gathered; false when `must` is
  // false and no slot is free.
  bool gather(int unit, bool must, const Sums& sums);
  // The unit's all-gathers into `out`, one per bucket of each group.
  std::vector<std::shared_ptr<Event>> issue(int unit, const Tensor& out, bool counted);
  Tensor hold(int unit);
  void unhold(int unit);
  void wait(int unit);
  void release(int unit);
  int evict_prefetched(const Sums& sums);
  void check(int unit) const;

  CommQueue& comm_;
  std::vector<UnitSpec> units_;
  std::vector<int64_t> unit_elems_;
  std::vector<std::vector<int64_t>> group_offsets_;
  std::vector<Tensor> own_;  // per unit: its own buffer, or undefined
  SlotPool pool_;
  std::vector<State> state_;
  int64_t prefetch_bytes_ = 0;
  DType dtype_ = DType::kFloat32;
  size_t elem_bytes_ = 4;
  GradsFinal grads_final_;
  bool in_forward_ = false, in_backward_ = false;
  bool aborted_ = false;  // a round reported another rank's failure: the pass ended there
  // The units in the order rounds first needed them in this step's forward,
  // and in the last step's: the same on every rank.
  std::vector<int> order_, last_order_;
  Tensor round_flags_;  // the round's control buffer
  int64_t rounds_ = 0;
  double round_seconds_ = 0;
};

}  // namespace zerocore
