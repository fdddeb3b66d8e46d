// Where stage 3's units live on this rank: the buffers their params are
// gathered in, the gathers in flight into them, and when the memory goes
// back. The unit schedule decides which units to gather and when (the
// rounds); this class carries a decision out on this rank (into which
// buffer, evicting or growing if it must) and keeps each unit's Residency
// (unit_state.h), so that slots, events and the unit's state change
// together and in one place.
//
// A unit is gathered into a slot of a fixed pool sized by the largest
// unit: one slot for the unit in use plus the prefetch window. A unit
// marked own_slot (the root, which stays gathered across the whole forward
// and backward of a typical model) has a buffer of its own. When the units
// a rank needs at once do not fit, an unused prefetch is evicted, then the
// pool grows (once: a slot is kept). A rank joins every gather the ranks
// agreed on: into its unit's buffer, or, when it has the unit already or
// has no room, into a slot lent for the collective alone. A shard in host
// memory (offload_params) is copied up before its gather.
#pragma once
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/schedule/slot_pool.h"
#include "zerocore/schedule/unit_state.h"
#include "zerocore/tensor.h"

namespace zerocore {

struct UnitSpec;  // unit_schedule.h

class GatherPool {
 public:
  // comm: the queue of the gathers. prefetch_bytes: the budget of units
  // gathered ahead of use; the pool has a slot for the next unit whenever
  // it is > 0.
  GatherPool(CommQueue& comm, std::vector<UnitSpec> units, DType dtype, int64_t prefetch_bytes);
  ~GatherPool();  // waits for gathers in flight
  GatherPool(const GatherPool&) = delete;
  GatherPool& operator=(const GatherPool&) = delete;

  // How this rank joins an agreed gather: it needs the unit now (a slot is
  // found, evicting or growing), it may keep it as a prefetch (if a slot is
  // free), or it only lends its shard (into a slot given back at once).
  enum class Join { kNeed, kPrefetch, kLend };
  void participate(int unit, Join how);
  // A hook uses the unit: its gather waited for (a stream wait), held
  // until let_go or release. The unit must be gathered.
  Tensor hold(int unit);
  // No hook uses the unit any more; it stays gathered (a root between its passes).
  void let_go(int unit);
  // The compute stream waits for the unit's gather, if one is in flight.
  void wait(int unit);
  // The unit's buffer goes back (after its gather); nothing when released.
  void release(int unit);
  void release_unheld();  // every unit no hook holds
  // After a round reported a failure: every unit is dropped, its gather's
  // own failure ignored (the failure being raised says why).
  void drop_all();
  // The compute stream reads the unit's gathered params (`what` they are read for).
  void declare_read(int unit, const char* what);
  // The unit's full flat params into `out`, outside the pool and uncounted.
  void gather_into(int unit, const Tensor& out);
  // A gather's stream-order check that failed while it was issued all the
  // same (with the rest of its round, in step with the other ranks): raised
  // once the round's decisions are all taken.
  void raise_unordered();

  int num_units() const { return int(placed_.size()); }
  bool has_own_buffer(int unit) const;
  int64_t unit_elems(int unit) const { return unit_elems_[size_t(unit)]; }
  int64_t group_offset(int unit, int group) const { return group_offsets_[size_t(unit)].at(size_t(group)); }
  Residency residency(int unit) const { return placed_[size_t(unit)].residency; }
  bool gathered(int unit) const { return residency(unit) != Residency::kReleased; }
  // The buffer the unit is gathered (or being gathered) in; undefined when released.
  const Tensor& buffer(int unit) const { return placed_[size_t(unit)].buffer; }
  bool holds_pooled() const;  // a hook holds a unit in a pool slot
  int free_slots() const { return pool_.free_slots(); }
  int planned_slots() const { return pool_.planned(); }
  int slots() const { return pool_.size(); }
  size_t bytes() const;  // the pool and the units' own buffers
  DType dtype() const { return dtype_; }

 private:
  struct Placed {
    Residency residency = Residency::kReleased;
    int slot = -1;  // pool slot; -1 for none (or the own buffer)
    Tensor buffer;  // where it is gathered; undefined when released
    std::vector<std::shared_ptr<StreamEvent>> pending;  // its gather's events, until compute waits for them
  };
  // The unit's all-gathers into `out`, one per bucket of each group.
  std::vector<std::shared_ptr<StreamEvent>> issue(int unit, const Tensor& out, bool counted);
  int evict_prefetched();  // a slot taken from an unused prefetch, or -1

  CommQueue& comm_;
  // The queue's backend, kept: a pool may outlive its queue (waiting for
  // nothing then), never its backend.
  Backend& backend_;
  std::vector<UnitSpec> units_;
  DType dtype_;
  std::vector<int64_t> unit_elems_;
  std::vector<std::vector<int64_t>> group_offsets_;
  // Per unit, per group: its shard is host memory (offload_params), copied
  // up before its gather.
  std::vector<std::vector<bool>> shard_on_host_;
  std::vector<Tensor> own_;  // per unit: its own buffer, or undefined
  SlotPool pool_;
  std::vector<Placed> placed_;
  std::exception_ptr unordered_;
};

}  // namespace zerocore
