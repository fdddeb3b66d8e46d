// Stage 3's schedule of units: where each unit's params are gathered, when
// their all-gathers are issued, and when the memory goes back to the pool.
// The module's hooks tell it what happened (a unit is about to run forward,
// its forward ended, its backward begins, its post-backward point); it
// decides the rest. Every rank runs the same schedule, so every rank issues
// the same collectives in the same order.
//
// A unit is gathered into a slot of a fixed pool sized by the largest unit:
// one slot for the unit in use plus the prefetch window. A unit marked
// own_slot (the root, which stays gathered across the whole forward and
// backward of a typical model) has a buffer of its own. Per unit:
//
//   released --gather--> gathering --wait--> gathered --hook--> held
//       ^                                                         |
//       +-------------------------- release ----------------------+
//
// A prefetch is a guess: it uses only a free slot, and a prefetched unit
// that is not yet held is evicted when a unit that must run needs its slot.
// Release happens at structural points: after a unit's forward (outside
// backward), at its post-backward point once every backward call of it has
// reached it, and for everything at the end of backward. Slots are reused
// only after the gather that wrote them completed; on the host the compute
// that read a slot has finished by the time its hook releases it.
#pragma once
#include <cstdint>
#include <memory>
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

class UnitSchedule {
 public:
  // prefetch_bytes: the budget of units gathered ahead of use; the next unit
  // is always prefetched when it is > 0.
  UnitSchedule(CommQueue& comm, std::vector<UnitSpec> units, DType dtype, int64_t prefetch_bytes);
  ~UnitSchedule();  // waits for gathers in flight
  UnitSchedule(const UnitSchedule&) = delete;
  UnitSchedule& operator=(const UnitSchedule&) = delete;

  // The hooks. pre_forward and pre_backward return the buffer the unit is
  // gathered in (valid until its release).
  Tensor pre_forward(int unit);
  void post_forward(int unit);
  void begin_backward();
  Tensor pre_backward(int unit);
  void post_backward(int unit);
  void end_forward();   // drops prefetches the forward did not use
  void end_backward();  // releases every unit
  void end_step();      // this step's forward order guides the next step's prefetch

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

 private:
  struct State {
    int slot = -1;      // pool slot; -1 for none (or the own buffer)
    Tensor buffer;      // where it is gathered; undefined when released
    std::vector<std::shared_ptr<Event>> pending;
    bool held = false;  // a hook uses it (not merely prefetched)
    int open_backwards = 0;
  };

  // Starts the unit's gather unless it is gathered; false when `must` is
  // false and no slot is free.
  bool gather(int unit, bool must);
  // The unit's all-gathers into `out`, one per bucket of each group.
  std::vector<std::shared_ptr<Event>> issue(int unit, const Tensor& out, bool counted);
  Tensor hold(int unit);
  void wait(int unit);
  void release(int unit);
  int evict_prefetched();
  // Starts gathering the units after `unit` in the order [begin, end).
  template <class It>
  void prefetch_after(int unit, It begin, It end);
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
  bool in_backward_ = false;
  std::vector<int> forward_order_, last_forward_order_;
};

}  // namespace zerocore
