// Stage 3's schedule of units: where each unit's params are gathered, when
// their all-gathers are issued, when the memory goes back to the pool and
// when a unit's grads are ready to be reduced. The module's hooks tell it
// what this rank did (a unit is about to run forward, its forward ended, its
// backward begins, its post-backward point); it decides the rest.
//
// Ranks may run different units (experts chosen by the data), a different
// number of times, so no collective is issued on one rank's say: the ranks
// agree on each in a *round*. Every unit hook that needs params posts one:
// a small control all-reduce in which each rank says, per unit, whether it
// needs it now (it is not gathered here), is at it, has it gathered, still
// expects its backward, and produced grads for it. A round is posted without
// waiting and settled at the next hook, so in a model whose ranks run the
// same units its all-reduce completes while the unit computes: the
// negotiation rides along with the prefetch it decides. Only a rank that
// needs a unit it does not have waits for its round at once. Settling a
// round, every rank takes the same decisions from the sums, in the same
// order:
//   1. gather every unit some rank needs, in unit order (the union);
//   2. prefetch along the previous step's agreed order (backward: this
//      step's, reversed) past the furthest unit any rank is at, what some
//      rank does not have, as many units as the fullest rank has room for;
//   3. in backward, reduce every unit that no rank expects a backward of
//      any more, in reduction order (last unit first, the root last): its
//      groups' buckets in the BucketReducer (set_grad_reducer) are
//      reduce-scattered, with zeros from the ranks that did not run it, or
//      skipped where no rank ran it.
// Every rank joins every gather so decided: into a free slot, or, when it
// has the unit already or no slot is free, into a slot lent for the
// collective alone. Releases need no agreement (a gathered unit is this
// rank's memory) and happen at once: after a unit's forward (outside
// backward), at its post-backward point once every backward call of it has
// reached it, and for everything at the end of a pass; a unit with a buffer
// of its own (the root) stays gathered from its forward to the end of its
// backward, as FSDP2 keeps its root. A rank that has finished its forward or
// backward keeps posting rounds (end_forward, end_backward) until every rank
// has, as torch's Join does for uneven inputs; after a backward the last
// round reduces every unit not reduced yet. The step's round
// (end_step) gathers what the next forward starts with. A rank whose pass
// raised says so in its round, and every other rank throws PeerFailed when
// it settles that round.
//
// The schedule is three parts, one concern each: the rounds as a wire
// protocol (RoundProtocol, round_protocol.h: the control buffer, posting,
// settling, the sums' layout), where the units live on this rank
// (GatherPool, gather_pool.h: slots, own buffers, gathers in flight,
// releases, each unit's Residency) and what the caller's params view
// (ParamBindings, param_bindings.h). This class composes them and keeps
// the decisions: what the sums mean (the three above), the joins at the
// ends of the passes, failure propagation, and each unit's calls and
// Grads (unit_state.h).
#pragma once
#include <cstdint>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/flat_group_buffer.h"
#include "zerocore/layout.h"
#include "zerocore/schedule/gather_pool.h"
#include "zerocore/schedule/param_bindings.h"
#include "zerocore/schedule/round_protocol.h"
#include "zerocore/schedule/unit_state.h"
#include "zerocore/tensor.h"

namespace zerocore {

struct UnitSpec {
  // The unit's flat groups, laid out one after another in its buffer, each
  // with this rank's shard (plan.partition_elems() elements).
  std::vector<FlatGroupBuffer> groups;
  bool own_slot = false;
};

class BucketReducer;

class UnitSchedule {
 public:
  // comm: the queue of the data collectives. rounds: a queue over another
  // communicator of the same ranks, for the rounds alone, so that a round
  // never waits behind the gathers and reductions queued before it.
  // prefetch_bytes: the budget of units gathered ahead of use; the next unit
  // is always prefetched when it is > 0.
  UnitSchedule(CommQueue& comm, CommQueue& rounds, std::vector<UnitSpec> units, DType dtype,
               int64_t prefetch_bytes);
  ~UnitSchedule();  // waits for the round and the gathers in flight
  UnitSchedule(const UnitSchedule&) = delete;
  UnitSchedule& operator=(const UnitSchedule&) = delete;

  // Where the units' grads are reduced: `reducer` (issuing on request; it
  // must outlive the schedule or be replaced first) and, per unit, the
  // places of its groups in the reducer's order. A round reduces a unit's
  // groups once every rank is done with its backward, or skips them where
  // no rank ran it, on every rank alike. Without a reducer (nothing
  // trains), grads are not reduced. Set again when the reducer is replaced.
  void set_grad_reducer(BucketReducer* reducer, std::vector<std::vector<int>> unit_groups);

  // What a hook hands back to its caller, whose params view the buffers
  // (param_bindings.h). So a hook is one call, and the caller never asks
  // where a unit is.
  using Binding = ParamBinding;

  // The hooks, one call each. pre_forward and pre_backward post a round
  // (and settle the previous one), wait (a stream wait) for the unit's
  // gather and bind it (valid until its release). Each declares the compute
  // stream's reads of the unit's params through Backend::declare_access:
  // the pre hooks the first read (after its gather), the post hooks the
  // last (before its slot can be gathered into again; a unit kept to the
  // end of the backward has no post-backward point, and only its first), so
  // the checking backend names a hook that reads a unit not ordered after
  // its gather, or a slot written while compute still reads it.
  // marks_post_backward: post_backward(unit) will be called once
  // this forward's backward has gone through the unit (its inputs need
  // grad).
  Binding pre_forward(int unit, bool marks_post_backward);
  // backward_follows: the unit's outputs need grad (it produces grads).
  Binding post_forward(int unit, bool backward_follows);
  // Completes the forward's join first: throws PeerFailed if a rank's
  // forward failed.
  void begin_backward();
  Binding pre_backward(int unit);
  Binding post_backward(int unit);
  // The units released since the caller last heard (by a hook's Binding
  // or by this call), forgotten as bound: after the calls that release
  // many (end_forward, end_backward, end_step, release_all) or one that
  // raised. unbind_all: the caller dropped every binding (gathered_params'
  // end), so the next hook binds afresh.
  std::vector<int> take_released();
  void unbind_all() { bindings_.unbind_all(); }
  // The unit's buffer for a read by compute outside its hooks (backward
  // unpacking a saved view of its params): its gather waited for and the
  // read declared; undefined when it is not gathered.
  Tensor read(int unit);
  // Rounds until every rank has ended its forward (backward), then releases
  // every unit (and reduces every unit not reduced yet). A rank
  // whose pass raised says `failed`: every other rank then throws
  // PeerFailed at the same round. end_forward does nothing when no forward
  // is open (it was ended already).
  void end_forward(bool failed = false);
  void end_backward(bool failed = false);
  // This step's agreed forward order guides the next step's prefetch; any
  // unit still gathered (a root kept after a forward with no backward) is
  // released, since the step changed its params; with a root, a round
  // gathers it and the first units of the order for the next forward.
  void end_step();
  // The same round carried by the step's exchange (ZeroStep), which costs
  // it no wait of its own: step_round_flags() releases every unit no hook
  // holds and gives this rank's flags (none without a root: no round),
  // before the update (the update changes no flag); end_step(summed) takes
  // them summed over the ranks in rank order, after it.
  std::vector<float> step_round_flags();
  void end_step(const std::vector<float>& summed);
  int64_t step_round_width() const;  // the number of step_round_flags()'s flags
  // Releases every unit no hook holds: their params changed (the step, an
  // edit inside gathered_params). Between passes, where every rank calls it.
  void release_all();

  // The unit's full flat params into `out` (unit_elems(unit) elements),
  // outside the pool and uncounted: for whole-model views.
  void gather_into(int unit, const Tensor& out);

  int num_units() const { return pool_.num_units(); }
  // Elements of the unit's buffer, and where group g starts in it.
  int64_t unit_elems(int unit) const;
  int64_t group_offset(int unit, int group) const;
  // The buffer the unit is gathered (or being gathered) in; undefined when released.
  Tensor buffer(int unit) const;
  bool gathered(int unit) const;
  // Bytes of every gather buffer: the pool and the units' own buffers.
  size_t buffer_bytes() const { return pool_.bytes(); }
  int pool_slots() const { return pool_.slots(); }
  // Rounds since construction; those a hook waited for at once (it needed
  // a unit that was not here, or its pass ended); and the seconds spent
  // waiting for rounds' all-reduces: what agreeing costs.
  int64_t rounds() const { return protocol_.rounds(); }
  int64_t blocking_rounds() const { return protocol_.blocking_rounds(); }
  double round_seconds() const { return protocol_.round_seconds(); }

 private:
  using Sums = RoundProtocol::Sums;
  using Join = GatherPool::Join;

  // A unit's calls in the pass: the counts that must stay counts (calls
  // nest and repeat), and its grads.
  struct UnitCalls {
    int open_backwards = 0;     // backward calls begun, not yet at their post-backward point
    int post_backwards_due = 0; // post_backward calls still to come
    bool unbounded = false;     // produces grads, with no post-backward point: open until the end
    std::vector<bool> marks;    // per forward call in progress: whether it marked a post-backward point
    Grads grads = Grads::kNone;
  };

  // Posts this rank's round; `need` is a unit it does not have (or -1),
  // `at` the unit its hook is at (or -1), `backward` the pass it is in (a
  // rank finishing the forward's join is still in the forward: the ranks
  // take a round's decisions for backward only when all are there);
  // `blocking`: this rank waits for it at once.
  void post(int need, int at, bool done, bool failed, bool backward, bool blocking);
  RoundProtocol::RankReport report(int need, int at, bool done, bool failed, bool backward, bool blocking) const;
  RoundProtocol::UnitReport unit_report(int unit) const;
  int root() const;  // the unit with a buffer of its own, or -1
  void next_order();  // this step's forward order becomes the last
  Sums settle();  // waits for the round posted, if any, then decide()
  Sums decide(const Sums& sums);  // acts on the round's summed flags
  Tensor acquire(int unit);  // a pre hook: settle, post, and wait only if the unit is not here
  void prefetch(const Sums& sums);
  void finalize_grads(const Sums& sums, bool all);
  void mark_grads_coming(int unit);
  // Rounds until every rank is done; the last releases every unit.
  void join(bool failed, bool backward);
  // Completes the join end_forward began, if one is open.
  void finish_join();
  // Settles this rank's posted done-round and posts more until a round
  // finds every rank done; that round ends the pass.
  void answer_until_done(bool failed, bool backward);
  void end_pass(const Sums& sums, bool backward);
  void reset_after_failure(bool failed_here);
  void check(int unit) const;

  // Declared in this order: the protocol is destroyed first (waiting for
  // the round in flight), then the pool (waiting for its gathers).
  GatherPool pool_;
  RoundProtocol protocol_;
  ParamBindings bindings_;
  std::vector<UnitCalls> calls_;
  int64_t prefetch_bytes_ = 0;
  BucketReducer* reducer_ = nullptr;
  std::vector<std::vector<int>> reduce_groups_;  // per unit: its groups' places in the reducer's order
  bool in_forward_ = false, in_backward_ = false;
  bool aborted_ = false;  // a round reported another rank's failure: the pass ended there
  bool joining_ = false;  // end_forward posted its done-round; the join is finished later
  // The units in the order rounds first needed them in this step's forward,
  // and in the last step's: the same on every rank.
  std::vector<int> order_, last_order_;
  int needed_ = -1;  // the unit this rank's hook waits for, while it settles the round that gathers it
};

}  // namespace zerocore
