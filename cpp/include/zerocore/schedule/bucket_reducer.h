// Gradient reduction of stages 2 and 3: the bucket state machine. A param's
// grad, once autograd has accumulated it, is added into the staging buffer of
// each bucket it overlaps; a bucket whose params have all reported is
// reduce-scattered in place on the comm queue, and once its event fires this
// rank's block is added into the group's grad partition and the staging
// buffer goes back to the pool. Only the partitions and a few constant-size
// staging buffers (ZeRO-R's constant-size buffers) outlive a backward.
//
// Buckets are issued in one fixed order on every rank (the groups' order,
// then plan order), whatever order their grads arrive in: a complete bucket
// waits for the ones before it. Ranks whose grads differ (a param unused on
// one rank) therefore issue the same collectives in the same order. At the
// end of backward every bucket not yet issued is, with zeros for the params
// that got no grad. A grad that arrives after its bucket was issued
// (reentrant checkpointing) is staged again, in a late bucket: the next
// backward's reduction of that bucket takes it along (gradient
// accumulation), and after the last backward of a step the ranks agree, in
// the step's one control exchange (ZeroStep), which buckets are late
// anywhere and all reduce those once more (reduce_late), so every rank
// issues the same collectives. A late grad on one rank only is why an
// agreement is needed at all; riding on the step's exchange, it costs no
// wait of its own.
//
// Stage 3 issues on request instead: ranks may run different units, so
// grads arrive at different points of the collective sequence, and only
// the unit schedule's rounds know when every rank is done with a unit
// (the UnitSchedule calls reduce_groups; skip_groups where no rank produced
// grads).
//
// Grads accumulate in place where they can: a param that lies in one bucket
// may have its piece of that bucket's staging buffer as its grad (a grad
// view), which autograd adds into, so grad_ready only notes it. Views exist
// only for buckets that hold staging, and a bucket is issued no sooner than
// each of its params has reported (or the backward ended), so a view is
// valid until its param's grad_ready or end_backward. Stage 3 asks for a
// group's views before its unit's backward (grad_views). Stage 2 is handed
// them as buckets take staging (begin_backward, then grad_ready): the first
// bucket to issue at the start, the next one once the one before went out,
// and one that an early grad opened; a param whose grad comes before its
// bucket holds staging is added instead, as is one that spans buckets.
//
//   empty --first grad, or its views--> staging --all params reported, its turn--> issued
//     (staging taken)                                (reduce-scatter in flight; once a bucket needs
//                                                     staging and none is free, or at the end, the
//                                                     shard is added and the staging goes back)
//   issued --a grad after it--> late: staged again, reduced at the step once the ranks agree
//   end of backward: issued -> empty, late -> staging (bucket_phase.h has every step)
//
// A grad partition in host memory (ZeRO-Offload's, stages 2-3) is filled
// on a stream of the reducer's own ("grads down"): each reduced shard is
// copied into a pinned landing buffer there, and added into the partition
// by the host, in that stream's order, while backward goes on; the compute
// stream waits only for the copy (to reuse the staging) and, at the end of
// backward, for the adds (what reads the partitions next is ordered after
// the compute stream).
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/flat_group_buffer.h"
#include "zerocore/layout.h"
#include "zerocore/schedule/bucket_phase.h"
#include "zerocore/schedule/slot_pool.h"
#include "zerocore/tensor.h"

namespace zerocore {

// Param `param` of group `group` may accumulate its grad in `view`, its
// piece of a staging buffer.
struct GradView {
  int group = 0, param = 0;
  Tensor view;
};

class BucketReducer {
 public:
  // grad_parts: per flat group, in reduction order (the reducer's group
  // indices below are places in it), the partition of the summed grads
  // this rank keeps, in the reduce dtype. staging_buffers: staging slots allocated up front (the pool grows past
  // them only when more buckets are open at once: a bucket that needs a slot
  // while all are taken first completes the reductions in flight, whose
  // slots come back). on_request: buckets are
  // issued only by reduce_groups() and end_backward(), never as they fill.
  BucketReducer(CommQueue& comm, std::vector<FlatGroupBuffer> grad_parts, DType reduce_dtype, int staging_buffers,
                bool on_request = false);
  ~BucketReducer();  // waits for reductions in flight
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Issuing as buckets fill (not on request), with grad views: a backward
  // begins. Takes staging for the first bucket to issue and returns the
  // views of its params; until end_backward, grad_ready hands out the views
  // of each bucket that takes staging in it. Without this call, grads are
  // added (a caller whose grads are not in the reduce dtype).
  std::vector<GradView> begin_backward();
  // Param `param` of group `group` has its grad for this backward: added
  // into its buckets' staging, or noted where it is its grad view already.
  // Returns the views of the params of buckets that took staging in this
  // call (after begin_backward; none reported yet, none spanning buckets).
  // grid (an int64 reduction, Config(deterministic=True)): grad is float,
  // put onto the grid of 2**grid.exponent as it is added, its largest
  // |value| kept in grid.largest (Backend::accumulate_on_grid: no int64
  // copy of it, no host wait).
  struct Grid {
    int exponent = 0;
    Tensor largest;  // one fp32 element where the grad is
  };
  std::vector<GradView> grad_ready(int group, int param, const Tensor& grad,
                                   const std::optional<Grid>& grid = std::nullopt);
  // Per param of the group, where its grad may accumulate in place (its
  // piece of a staging buffer, taken now), or an undefined tensor when it
  // must be added instead: a param spanning buckets, or one whose bucket was
  // already issued.
  std::vector<Tensor> grad_views(int group);
  // Issues every bucket of these groups not yet issued, in this order; the
  // same calls on every rank.
  void reduce_groups(const std::vector<int>& groups);
  // These groups got no grad on any rank (the caller knows it from every
  // rank): their buckets are done without a collective. A grad staged here
  // anyway is late (late(): the step's exchange has it reduced).
  void skip_groups(const std::vector<int>& groups);
  // Issues what is left (zeros for params that got no grad) and completes
  // every reduction into the partitions. Late grads stay staged (late()).
  void end_backward();
  // Between backwards: the buckets holding grads staged after their
  // reduction (one flag a bucket, in the reducer's order).
  std::vector<bool> late() const;
  // Reduces these buckets (the ranks agreed on them: the same on every
  // rank; zeros where this rank staged nothing) and completes the
  // reductions; no bucket is late after it.
  void reduce_late(const std::vector<bool>& buckets);
  // Drops the late grads (zero_grad).
  void drop_late();
  // The sum of squares of the grad partitions (the step's, after
  // reduce_late) into `box`, on the compute stream (Backend::sum_of_squares).
  void grad_sum_of_squares(Mailbox& box, int sum_slot, int finite_slot) const;
  // The reduced partitions themselves (what grad_sum_of_squares is over).
  std::vector<Tensor> partitions() const;
  // Where each group's reduced grads are added from now on (the same
  // dtype and size as before): a delayed offload update reads one buffer
  // while the next backward fills the other. Between backwards only
  // (InvalidArgument otherwise).
  void set_grad_partitions(const std::vector<Tensor>& grad_parts);

  int num_groups() const { return int(groups_.size()); }
  bool on_request() const { return on_request_; }
  size_t staging_bytes() const { return pool_.bytes(); }  // device memory
  size_t landing_bytes() const { return landing_.bytes(); }  // host memory, with host partitions
  int staging_slots() const { return pool_.size(); }

 private:
  struct Piece {      // the part of one param inside one bucket
    int bucket;       // index into buckets_
    int64_t param_offset, staging_offset, numel;
  };
  struct BucketState {
    int group, bucket;
    int params = 0;   // params with elements in this bucket
    int waiting = 0;  // of those, not yet reported this backward
    BucketPhase phase = BucketPhase::kEmpty;
    int staging = -1;     // the pool slot of its staged grads where holds_staging(phase)
    bool viewed = false;  // its params' views were handed out in this backward
  };
  struct InFlight {
    int bucket, staging;
    std::shared_ptr<StreamEvent> event;
  };

  void check_grad_part(const FlatGroupBuffer& group, const Tensor& grad_part) const;
  bool on_host(const Tensor& grad_part) const;  // host memory of the backend's (an offloaded partition)
  bool between_backwards() const;
  int take_staging(int index);  // bucket index's staging slot, taken (zeroed) if it holds none
  // Moves bucket `index` to phase `to` (advance, naming the bucket).
  void advance_bucket(int index, BucketPhase to);
  // The param's grad view, or undefined (see grad_views).
  Tensor view(int group, int param);
  // Hands out the views of the params that lie in the bucket alone and have
  // not reported, once a backward (taking its staging for them); nothing
  // for an issued bucket.
  void open(int bucket, std::vector<GradView>& views);
  void issue_ready();
  void issue(int bucket);
  void complete_oldest();
  // The compute stream is ordered after every add into a host partition.
  void host_partitions_done();
  const std::vector<Piece>& pieces(int group, int param) const;
  // The buckets of group `group`, as indices into buckets_.
  std::pair<int, int> bucket_range(int group) const;

  CommQueue& comm_;
  // The queues' backend, kept: a reducer may outlive its queues (waiting
  // for nothing then), never their backend.
  Backend& backend_;
  std::vector<FlatGroupBuffer> groups_;  // their buffers: the grad partitions
  DType reduce_dtype_;
  std::vector<BucketState> buckets_;
  std::vector<std::vector<std::vector<Piece>>> pieces_;  // [group][param]
  std::vector<std::vector<std::vector<bool>>> reported_;  // [group][param][piece]
  SlotPool pool_;
  // Per group, whether its grad partition is host memory; with any, the
  // stream its shards go down on and the landing buffer they arrive in
  // (one: every use of it is on that stream, in order).
  std::vector<bool> on_host_;
  Stream* down_ = nullptr;
  SlotPool landing_;
  std::deque<InFlight> in_flight_;
  size_t next_ = 0;    // the next bucket to issue
  bool on_request_ = false;
  bool hands_out_views_ = false;  // begin_backward was called in this backward
  std::vector<int> first_bucket_;  // per group: its first index in buckets_
};

}  // namespace zerocore
