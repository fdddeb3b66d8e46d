#include "zerocore/schedule/unit_schedule.h"

#include <algorithm>
#include <string>
#include <utility>

#include "zerocore/error.h"
#include "zerocore/schedule/bucket_reducer.h"

namespace zerocore {

namespace {

// The data queue, once the rounds' queue is checked against it: before
// anything is allocated for the units.
CommQueue& checked_queues(CommQueue& comm, CommQueue& rounds) {
  if (rounds.world_size() != comm.world_size() || rounds.rank() != comm.rank()) {
    throw InvalidArgument("UnitSchedule: the rounds' queue must connect the same ranks as the data queue");
  }
  if (&rounds.backend() != &comm.backend()) {
    throw InvalidArgument("UnitSchedule: the rounds' queue must be on the data queue's backend");
  }
  return comm;
}

}  // namespace

UnitSchedule::UnitSchedule(CommQueue& comm, CommQueue& rounds, std::vector<UnitSpec> units, DType dtype,
                           int64_t prefetch_bytes)
    : pool_(checked_queues(comm, rounds), std::move(units), dtype, prefetch_bytes),
      protocol_(rounds, pool_.num_units(), pool_.planned_slots()),
      bindings_(pool_),
      calls_(size_t(pool_.num_units())),
      prefetch_bytes_(prefetch_bytes),
      reduce_groups_(size_t(pool_.num_units())) {}

UnitSchedule::~UnitSchedule() = default;

void UnitSchedule::set_grad_reducer(BucketReducer* reducer, std::vector<std::vector<int>> unit_groups) {
  if (reducer != nullptr && !reducer->on_request()) {
    throw InvalidArgument("UnitSchedule.set_grad_reducer: the reducer must issue on request (on_request=true): "
                          "the rounds say when a unit's grads are reduced, the same on every rank, not their arrival");
  }
  if (unit_groups.size() != size_t(num_units())) {
    throw InvalidArgument("UnitSchedule.set_grad_reducer: groups for " + std::to_string(unit_groups.size()) +
                          " units, the schedule has " + std::to_string(num_units()));
  }
  for (const std::vector<int>& groups : unit_groups) {
    for (int g : groups) {
      if (reducer == nullptr || g < 0 || g >= reducer->num_groups()) {
        throw InvalidArgument("UnitSchedule.set_grad_reducer: group " + std::to_string(g) + " is not a place in " +
                              "the reducer's order" + (reducer ? " of " + std::to_string(reducer->num_groups()) +
                                                                     " groups" : " (no reducer)"));
      }
    }
  }
  reducer_ = reducer;
  reduce_groups_ = std::move(unit_groups);
}

void UnitSchedule::check(int unit) const {
  if (unit < 0 || unit >= num_units()) {
    throw InvalidArgument("UnitSchedule: unit " + std::to_string(unit) + " is not one of the " +
                          std::to_string(num_units()) + " units");
  }
}

int64_t UnitSchedule::unit_elems(int unit) const {
  check(unit);
  return pool_.unit_elems(unit);
}

int64_t UnitSchedule::group_offset(int unit, int group) const {
  check(unit);
  return pool_.group_offset(unit, group);
}

Tensor UnitSchedule::buffer(int unit) const {
  check(unit);
  return pool_.buffer(unit);
}

bool UnitSchedule::gathered(int unit) const {
  check(unit);
  return pool_.gathered(unit);
}

std::vector<int> UnitSchedule::take_released() { return bindings_.take_released(); }

Tensor UnitSchedule::read(int unit) {
  check(unit);
  if (!pool_.gathered(unit)) return Tensor();
  pool_.wait(unit);
  pool_.declare_read(unit, "params read by backward (a saved view)");
  return pool_.buffer(unit);
}

void UnitSchedule::gather_into(int unit, const Tensor& out) {
  check(unit);
  pool_.gather_into(unit, out);
}

// Rounds ----------------------------------------------------------------------

RoundProtocol::UnitReport UnitSchedule::unit_report(int unit) const {
  // Ran: grads coming, not yet reduced (a reduced unit's flags decide nothing any more).
  const UnitCalls& c = calls_[size_t(unit)];
  return {pool_.gathered(unit), c.post_backwards_due > 0 || c.unbounded, c.grads == Grads::kComing};
}

RoundProtocol::RankReport UnitSchedule::report(int need, int at, bool done, bool failed, bool backward,
                                               bool blocking) const {
  // Room by the time the round settles: the unit this hook is at is done by
  // then, as a rule (not for a unit that holds nested ones: a lent slot then).
  const bool at_done = at >= 0 && !pool_.has_own_buffer(at) && pool_.gathered(at);
  return {need, at, done, failed, backward, pool_.free_slots() + (at_done ? 1 : 0), blocking};
}

void UnitSchedule::post(int need, int at, bool done, bool failed, bool backward, bool blocking) {
  protocol_.post(report(need, at, done, failed, backward, blocking), [this](int u) { return unit_report(u); });
}

UnitSchedule::Sums UnitSchedule::settle() {
  const Sums sums = protocol_.settle();
  return sums ? decide(sums) : sums;
}

UnitSchedule::Sums UnitSchedule::decide(const Sums& sums) {
  const int n = num_units();
  if (sums.failed > 0) {
    reset_after_failure(sums.failed_here);
    if (!sums.failed_here) {
      throw PeerFailed("zerocore: " + std::to_string(int(sums.failed)) + " other rank(s) failed during this " +
                       (in_backward_ ? "backward" : "forward") +
                       " (their errors say why); this rank stopped with them at the same point, so that no rank "
                       "waits for the others forever");
    }
    return sums;
  }
  for (int u = 0; u < n; ++u) {
    if (sums.need(u) > 0) {
      pool_.participate(u, u == needed_ ? Join::kNeed : Join::kLend);
    } else if (pool_.has_own_buffer(u) && sums.at(u) > 0 && !sums.all_have(u)) {
      pool_.participate(u, Join::kPrefetch);  // a buffer of its own: gathering it ahead costs no slot
    }
  }
  if (!sums.backward) {
    for (int u = 0; u < n; ++u) {
      if ((sums.at(u) > 0 || sums.need(u) > 0) && !pool_.has_own_buffer(u) &&
          std::find(order_.begin(), order_.end(), u) == order_.end()) {
        order_.push_back(u);
      }
    }
  }
  prefetch(sums);
  if (sums.backward) finalize_grads(sums, false);
  // The rank's hook then fails as at any error of its own, and the others
  // hear of it in the round its failed pass posts next.
  pool_.raise_unordered();
  return sums;
}

void UnitSchedule::prefetch(const Sums& sums) {
  // Forward follows the last step's order; backward this step's, reversed.
  const std::vector<int>& order = sums.backward ? order_ : last_order_;
  const int n = int(order.size());
  auto at = [&](int i) { return sums.backward ? order[size_t(n - 1 - i)] : order[size_t(i)]; };
  int from = -1;  // the furthest unit a rank is at; -1: none of the pool's (the root, which encloses them all)
  for (int i = 0; i < n; ++i) {
    if (sums.at(at(i)) > 0) from = i;
  }
  bool needs = false, pooled_need = false, at_own = false;
  for (int u = 0; u < num_units(); ++u) {
    needs = needs || sums.need(u) > 0;
    pooled_need = pooled_need || (sums.need(u) > 0 && !pool_.has_own_buffer(u));
    at_own = at_own || (pool_.has_own_buffer(u) && sums.at(u) > 0);
  }
  if (prefetch_bytes_ <= 0 || (from < 0 && !needs && !at_own)) return;
  // The pool holds the unit in use and the window after it. A rank that
  // needed a unit waits for this round and uses the furthest unit now; the
  // others settle it at their next hook, by when the unit after it is in use.
  const int in_use = from + (needs ? 0 : 1);
  const int window = pool_.planned_slots() - (in_use >= 0 && in_use < n ? 1 : 0);
  // As many as the fullest rank has room for, less the slot a need just took.
  int room = sums.min_free - (pooled_need ? 1 : 0);
  for (int i = from + 1; i < std::min(n, in_use + 1 + window) && room > 0; ++i) {
    if (!sums.all_have(at(i))) {
      pool_.participate(at(i), Join::kPrefetch);
      --room;
    }
  }
}

void UnitSchedule::finalize_grads(const Sums& sums, bool all) {
  for (int u = num_units() - 1; u >= 0; --u) {  // reduction order: the root, unit 0, last
    UnitCalls& c = calls_[size_t(u)];
    const bool ran = sums.ran(u) > 0;
    if (c.grads == Grads::kReduced || !(all || (ran && sums.expects(u) == 0))) continue;
    advance(u, c.grads, Grads::kReduced);
    if (reducer_ == nullptr) continue;
    if (ran) {
      reducer_->reduce_groups(reduce_groups_[size_t(u)]);
    } else {
      reducer_->skip_groups(reduce_groups_[size_t(u)]);  // no rank has grads: nothing to reduce
    }
  }
}

void UnitSchedule::mark_grads_coming(int unit) {
  // Reduced already (the ranks agreed no call of it was still to come): a
  // later call's grads arrive at the reducer late, which says what that means.
  Grads& grads = calls_[size_t(unit)].grads;
  if (grads == Grads::kNone) advance(unit, grads, Grads::kComing);
}

void UnitSchedule::join(bool failed, bool backward) {
  finish_join();
  if (aborted_ || settle().failed > 0) return;
  post(-1, -1, true, failed, backward, true);
  answer_until_done(failed, backward);
}

void UnitSchedule::finish_join() {
  if (!joining_) return;
  joining_ = false;
  answer_until_done(false, false);  // still the forward's join, wherever this rank is now
}

void UnitSchedule::answer_until_done(bool failed, bool backward) {
  for (;;) {
    const Sums sums = settle();  // this rank's done-round
    if (sums.failed > 0) return;
    if (sums.all_done()) return end_pass(sums, backward);
    post(-1, -1, true, failed, backward, true);
  }
}

void UnitSchedule::end_pass(const Sums& sums, bool backward) {
  // Every rank is at this same round: the pass is over everywhere. A unit
  // with a buffer of its own (the root) stays gathered from its forward to
  // the end of its backward.
  for (int u = 0; u < num_units(); ++u) {
    UnitCalls& c = calls_[size_t(u)];
    c.open_backwards = 0;
    c.marks.clear();
    pool_.let_go(u);
    if (backward || !pool_.has_own_buffer(u)) pool_.release(u);
  }
  if (backward) {
    finalize_grads(sums, true);
    for (int u = 0; u < num_units(); ++u) {
      UnitCalls& c = calls_[size_t(u)];
      advance(u, c.grads, Grads::kNone);
      c.unbounded = false;
      c.post_backwards_due = 0;
    }
  }
}

void UnitSchedule::reset_after_failure(bool failed_here) {
  // Every rank settles this same round: each drops all it gathered.
  pool_.drop_all();
  std::fill(calls_.begin(), calls_.end(), UnitCalls{});
  in_forward_ = false;
  needed_ = -1;  // a hook that raised in the round that gathers its unit
  aborted_ = !failed_here;  // this rank throws; its end_forward/end_backward then has nothing to join
}

// Hooks -----------------------------------------------------------------------

Tensor UnitSchedule::acquire(int unit) {
  finish_join();
  // A unit with a buffer of its own that is here, whose hook comes while a
  // pooled unit is in use (the root of a Sequential, whose backward starts
  // with its last unit's), has nothing to tell the others: a round here
  // would be settled before that unit is done, and count its slot free.
  if (pool_.has_own_buffer(unit) && pool_.gathered(unit) && pool_.holds_pooled()) return pool_.hold(unit);
  settle();
  if (pool_.gathered(unit)) {
    post(-1, unit, false, false, in_backward_, false);  // settled at the next hook, while this unit computes
  } else {
    needed_ = unit;
    post(unit, unit, false, false, in_backward_, true);
    settle();  // the round that gathers it: wait for it now
    needed_ = -1;
    post(-1, unit, false, false, in_backward_, false);  // and one for the next hook to settle: its prefetch
  }
  return pool_.hold(unit);
}

// A hook's declarations come where its state is whole (its round posted,
// nothing half released), so a StreamOrderError they raise fails the pass
// as any error of the hook would, and the other ranks hear of it in the
// failed pass's round.

UnitSchedule::Binding UnitSchedule::pre_forward(int unit, bool marks_post_backward) {
  check(unit);
  if (!in_backward_ && !in_forward_) {
    in_forward_ = true;
    aborted_ = false;
  }
  acquire(unit);
  UnitCalls& c = calls_[size_t(unit)];
  c.marks.push_back(marks_post_backward);
  if (marks_post_backward) ++c.post_backwards_due;
  pool_.declare_read(unit, "forward reads its params");
  return bindings_.bind(unit);
}

UnitSchedule::Binding UnitSchedule::post_forward(int unit, bool backward_follows) {
  check(unit);
  pool_.declare_read(unit, "forward ends reading its params");
  UnitCalls& c = calls_[size_t(unit)];
  const bool marked = !c.marks.empty() && c.marks.back();
  if (!c.marks.empty()) c.marks.pop_back();
  if (backward_follows) {
    mark_grads_coming(unit);
    if (!marked) c.unbounded = true;  // its grads come, but no post-backward point tells when they are complete
  }
  // In backward: a recomputation, held until its post-backward point. A
  // unit with a buffer of its own (the root, whose forward ends last and
  // whose backward starts first) stays gathered for its backward.
  if (!in_backward_) {
    pool_.let_go(unit);
    if (!pool_.has_own_buffer(unit)) pool_.release(unit);
  }
  return bindings_.unbound();
}

void UnitSchedule::begin_backward() {
  // The forward's join ends here, not at the first backward hook: a rank
  // whose forward failed is heard of before this rank's backward starts
  // (PeerFailed, naming the forward), so no rank goes into a backward, and
  // its reductions, that a failed rank will never join.
  finish_join();
  in_backward_ = true;
}

UnitSchedule::Binding UnitSchedule::pre_backward(int unit) {
  check(unit);
  ++calls_[size_t(unit)].open_backwards;
  mark_grads_coming(unit);
  acquire(unit);
  pool_.declare_read(unit, "backward reads its params");
  return bindings_.bind(unit);
}

UnitSchedule::Binding UnitSchedule::post_backward(int unit) {
  check(unit);
  pool_.declare_read(unit, "backward ends reading its params");
  UnitCalls& c = calls_[size_t(unit)];
  c.post_backwards_due = std::max(0, c.post_backwards_due - 1);
  c.open_backwards = std::max(0, c.open_backwards - 1);
  if (c.open_backwards == 0) pool_.release(unit);
  return bindings_.unbound();
}

void UnitSchedule::end_forward(bool failed) {
  if (in_backward_) return;
  if (aborted_) {
    aborted_ = false;
    return;
  }
  if (!in_forward_ && !failed) return;  // ended already
  in_forward_ = false;
  if (failed) return join(true, false);  // at once: the other ranks must hear of it
  // The rounds until every rank's forward has ended are settled by whatever
  // comes next (a backward hook, the next forward, the step), so this
  // rank's done-round travels while the loss is computed.
  settle();
  post(-1, -1, true, false, false, false);
  joining_ = true;
}

void UnitSchedule::end_backward(bool failed) {
  if (aborted_) {
    aborted_ = false;
  } else {
    join(failed, true);
  }
  in_backward_ = false;
}

int UnitSchedule::root() const {
  for (int u = 0; u < num_units(); ++u) {
    if (pool_.has_own_buffer(u)) return u;
  }
  return -1;
}

void UnitSchedule::next_order() {
  if (!order_.empty()) last_order_.swap(order_);
  order_.clear();
}

void UnitSchedule::end_step() {
  next_order();
  release_all();
  // The next forward starts with the units of its own buffer (the root) and
  // the first of the order: one round gathers them now, so that the gathers
  // overlap what comes before that forward.
  if (root() < 0) return;
  post(-1, root(), false, false, false, true);
  settle();
}

int64_t UnitSchedule::step_round_width() const { return root() < 0 ? 0 : protocol_.width(); }

std::vector<float> UnitSchedule::step_round_flags() {
  release_all();
  if (root() < 0) return {};
  return protocol_.flags(report(-1, root(), false, false, false, false), [this](int u) { return unit_report(u); });
}

void UnitSchedule::end_step(const std::vector<float>& summed) {
  next_order();
  release_all();  // units gathered since the flags were taken (a whole-model view) held the old params
  if (int64_t(summed.size()) != step_round_width()) {
    throw InvalidArgument("UnitSchedule::end_step: " + std::to_string(summed.size()) + " summed flags for a round of " +
                          std::to_string(step_round_width()));
  }
  if (summed.empty()) return;
  decide(protocol_.adopt(summed));  // the sums are here already: nothing to wait for
}

void UnitSchedule::release_all() {
  finish_join();
  settle();
  pool_.release_unheld();
}

}  // namespace zerocore
