#include "zerocore/schedule/unit_schedule.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "zerocore/backend/checking_backend.h"
#include "zerocore/error.h"
#include "zerocore/schedule/bucket_reducer.h"

namespace zerocore {

UnitSchedule::UnitSchedule(CommQueue& comm, CommQueue& rounds, std::vector<UnitSpec> units, DType dtype,
                           int64_t prefetch_bytes)
    : comm_(comm), rounds_queue_(rounds), backend_(comm.backend()), units_(std::move(units)), own_(units_.size()), state_(units_.size()),
      bound_(units_.size(), nullptr),
      prefetch_bytes_(prefetch_bytes), dtype_(dtype), elem_bytes_(dtype_size(dtype)),
      reduce_groups_(units_.size()) {
  if (rounds.world_size() != comm.world_size() || rounds.rank() != comm.rank()) {
    throw InvalidArgument("UnitSchedule: the rounds' queue must connect the same ranks as the data queue");
  }
  if (&rounds.backend() != &comm.backend()) {
    throw InvalidArgument("UnitSchedule: the rounds' queue must be on the data queue's backend");
  }
  int64_t largest = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    int64_t elems = 0;
    group_offsets_.emplace_back();
    shard_on_host_.emplace_back();
    for (const FlatGroupBuffer& g : units_[u].groups) {
      if (g.buffer.dtype() != dtype || g.buffer.numel() != g.plan.partition_elems()) {
        throw InvalidArgument("UnitSchedule: unit " + std::to_string(u) + ", group " + std::to_string(g.tag) +
                              ": the shard must be " + std::to_string(g.plan.partition_elems()) + " elements of " +
                              dtype_name(dtype));
      }
      group_offsets_.back().push_back(elems);
      elems += g.plan.total_elems();  // a multiple of world x alignment: the next group stays aligned
      const std::optional<MemoryKind> kind = backend_.kind_of(g.buffer.data());
      shard_on_host_.back().push_back(kind && *kind != MemoryKind::kDevice);
    }
    unit_elems_.push_back(elems);
    if (units_[u].own_slot) {
      own_[u] = Tensor::empty({elems}, dtype, backend_, MemoryKind::kDevice,
                              "unit " + std::to_string(u) + "'s own buffer");
    } else {
      largest = std::max(largest, elems);
    }
  }
  // The unit in use and the prefetch window (the next unit always, more
  // while they fit in prefetch_bytes), and never more than there are units.
  const int64_t slot_bytes = std::max<int64_t>(1, largest * int64_t(elem_bytes_));
  const int64_t window = prefetch_bytes <= 0 ? 0 : std::max<int64_t>(1, prefetch_bytes / slot_bytes);
  const int64_t pooled = std::count_if(units_.begin(), units_.end(), [](const UnitSpec& u) { return !u.own_slot; });
  pool_ = SlotPool(dtype, largest, int(std::min(1 + window, pooled)), backend_, MemoryKind::kDevice, "gathered units");
  // A control buffer, not an arena: it is no communication buffer of the plan.
  // + done, failed, backward, and one per count of free slots (0 to planned): the fewest any rank has.
  auto flags = std::make_shared<std::vector<float>>(units_.size() * kFlags + kGlobals + size_t(pool_.planned()) + 1);
  round_flags_ = Tensor(flags->data(), DType::kFloat32, Device{}, {int64_t(flags->size())}, flags);
}

UnitSchedule::~UnitSchedule() {
  if (posted_) {
    try {
      backend_.host_wait(*posted_);
    } catch (...) {  // as below
    }
  }
  for (State& s : state_) {
    for (auto& e : s.pending) {
      try {
        backend_.host_wait(*e);
      } catch (...) {  // the queue's error was raised to whoever waited first
      }
    }
  }
}

void UnitSchedule::set_grad_reducer(BucketReducer* reducer, std::vector<std::vector<int>> unit_groups) {
  if (reducer != nullptr && !reducer->on_request()) {
    throw InvalidArgument("UnitSchedule.set_grad_reducer: the reducer must issue on request (on_request=true): "
                          "the rounds say when a unit's grads are reduced, the same on every rank, not their arrival");
  }
  if (unit_groups.size() != units_.size()) {
    throw InvalidArgument("UnitSchedule.set_grad_reducer: groups for " + std::to_string(unit_groups.size()) +
                          " units, the schedule has " + std::to_string(units_.size()));
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
  return unit_elems_[size_t(unit)];
}

int64_t UnitSchedule::group_offset(int unit, int group) const {
  check(unit);
  return group_offsets_[size_t(unit)].at(size_t(group));
}

Tensor UnitSchedule::buffer(int unit) const {
  check(unit);
  return state_[size_t(unit)].buffer;
}

size_t UnitSchedule::buffer_bytes() const {
  size_t bytes = pool_.bytes();
  for (const Tensor& t : own_) bytes += t.nbytes();
  return bytes;
}

std::vector<std::shared_ptr<StreamEvent>> UnitSchedule::issue(int unit, const Tensor& out, bool counted) {
  std::vector<std::shared_ptr<StreamEvent>> events;
  const UnitSpec& spec = units_[size_t(unit)];
  // Each bucket's (shard, output). A shard in host memory (offload_params)
  // goes up first, on the compute stream, into this rank's block of the
  // output, which is then gathered in place: a data-plane collective moves
  // device memory.
  std::vector<std::pair<Tensor, Tensor>> gathers;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const FlatGroupBuffer& group = spec.groups[g];
    const int64_t base = group_offsets_[size_t(unit)][g];
    for (int b = 0; b < int(group.plan.buckets().size()); ++b) {
      const Bucket& bucket = group.plan.buckets()[size_t(b)];
      const int64_t shard = group.plan.shard_elems(b);
      const Tensor output = out.slice(base + bucket.offset, bucket.numel);
      Tensor input = group.buffer.slice(group.plan.partition_offset(b), shard);
      if (shard_on_host_[size_t(unit)][g]) {
        const Tensor mine = output.slice(comm_.rank() * shard, shard);
        backend_.copy(backend_.compute_stream(), mine, input);
        input = mine;
      }
      gathers.emplace_back(input, output);
    }
  }
  // What compute last did with `out` (a slot's previous unit) is done, and the shards that went up.
  backend_.wait(comm_.stream(), *backend_.record(backend_.compute_stream()));
  size_t next = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const FlatGroupBuffer& group = spec.groups[g];
    for (int b = 0; b < int(group.plan.buckets().size()); ++b) {
      const Bucket& bucket = group.plan.buckets()[size_t(b)];
      const CollectiveKey key{CollectiveKind::kAllGather, group.tag, b, bucket.numel};
      const auto& [input, output] = gathers[next++];
      try {
        events.push_back(comm_.all_gather(key, input, output, counted));
      } catch (const StreamOrderError&) {
        // Issued all the same (CommQueue::enqueue), as the other ranks issue
        // it and the rest of the round's gathers: this rank goes on with
        // them, in step, and raises once the round's decisions are taken.
        // Its event is lost; the queue's later ones come after it.
        if (!unordered_) unordered_ = std::current_exception();
      }
    }
  }
  return events;
}

void UnitSchedule::participate(int unit, Join how) {
  State& s = state_[size_t(unit)];
  if (s.buffer.data() == nullptr && how != Join::kLend) {
    const bool own = units_[size_t(unit)].own_slot;
    int slot = own ? -1 : pool_.try_acquire();
    if (!own && slot < 0 && how == Join::kNeed) slot = evict_prefetched();
    if (!own && slot < 0 && how == Join::kNeed) slot = pool_.acquire();  // more units at once than planned: grow
    if (own || slot >= 0) {
      s.slot = slot;
      s.buffer = own ? own_[size_t(unit)] : pool_.slot(slot).slice(0, unit_elems_[size_t(unit)]);
      s.pending = issue(unit, s.buffer, true);
      return;
    }
  }
  // Here already, not wanted, or no room: this rank only lends its shard,
  // into a slot that goes back once the gather has written it (a unit with
  // a buffer of its own is larger than a slot: a temporary one of the
  // backend's, freed once gathered into, a rare case).
  const int64_t elems = unit_elems_[size_t(unit)];
  const bool pooled = !units_[size_t(unit)].own_slot;
  const int lent = pooled ? pool_.acquire() : -1;
  const Tensor out = pooled ? pool_.slot(lent).slice(0, elems)
                            : Tensor::empty({elems}, dtype_, backend_, MemoryKind::kDevice,
                                            "unit " + std::to_string(unit) + " lent to a gather (temporary)");
  for (auto& e : issue(unit, out, true)) backend_.host_wait(*e);
  if (pooled) pool_.release(lent);
}

int UnitSchedule::evict_prefetched() {
  for (int u = 0; u < num_units(); ++u) {
    State& s = state_[size_t(u)];
    if (s.slot >= 0 && !s.held) {
      const int slot = s.slot;
      wait(u);
      s.slot = -1;
      s.buffer = Tensor();
      return slot;  // still taken: handed straight to the caller
    }
  }
  return -1;
}

void UnitSchedule::wait(int unit) {
  State& s = state_[size_t(unit)];
  // Clear first: a failed gather is raised once, and the unit can still be released.
  std::vector<std::shared_ptr<StreamEvent>> pending;
  pending.swap(s.pending);
  // The compute stream reads the unit's params (and a released slot's next
  // gather is ordered behind compute by the comm stream's own wait).
  for (auto& e : pending) backend_.wait(backend_.compute_stream(), *e);
}

void UnitSchedule::release(int unit) {
  State& s = state_[size_t(unit)];
  if (s.buffer.data() == nullptr) return;
  wait(unit);  // the gather writes into the slot until its event
  if (s.slot >= 0) pool_.release(s.slot);
  s.slot = -1;
  s.buffer = Tensor();
}

Tensor UnitSchedule::hold(int unit) {
  wait(unit);
  State& s = state_[size_t(unit)];
  s.held = true;
  return s.buffer;
}

void UnitSchedule::declare_read(int unit, const char* what) {
  const Tensor& buffer = state_[size_t(unit)].buffer;
  if (buffer.data() == nullptr) return;
  backend_.declare_access(backend_.compute_stream(), Access::read(buffer),
                          "unit " + std::to_string(unit) + "'s " + what);
}

// Binding ---------------------------------------------------------------------

std::vector<int> UnitSchedule::take_released() {
  std::vector<int> released;
  for (int u = 0; u < num_units(); ++u) {
    const void*& bound = bound_[size_t(u)];
    if (bound != nullptr && bound != state_[size_t(u)].buffer.data()) {
      released.push_back(u);
      bound = nullptr;
    }
  }
  return released;
}

UnitSchedule::Binding UnitSchedule::bind(int unit, const Tensor& buffer) {
  Binding b{buffer, bound_[size_t(unit)] != buffer.data(), take_released()};
  bound_[size_t(unit)] = buffer.data();
  return b;
}

Tensor UnitSchedule::read(int unit) {
  check(unit);
  if (!gathered(unit)) return Tensor();
  wait(unit);
  declare_read(unit, "params read by backward (a saved view)");
  return state_[size_t(unit)].buffer;
}

// Rounds ----------------------------------------------------------------------

void UnitSchedule::post(int need, int at, bool done, bool failed, bool backward) {
  fill_flags(need, at, done, failed, backward);
  if (comm_.world_size() == 1) {  // one rank: its flags are the sums, nothing to agree on
    posted_ = backend_.record(backend_.compute_stream());  // complete
  } else {
    posted_ = rounds_queue_.all_reduce(CollectiveKey{CollectiveKind::kAllReduce, -1, 0, round_flags_.numel()},
                                      round_flags_);
  }
  posted_failed_ = failed;
  ++rounds_;
}

void UnitSchedule::fill_flags(int need, int at, bool done, bool failed, bool backward) {
  const int n = num_units();
  float* flags = round_flags_.data_as<float>();
  for (int u = 0; u < n; ++u) {
    const State& s = state_[size_t(u)];
    float* f = flags + size_t(u) * kFlags;
    f[kNeed] = u == need ? 1.0f : 0.0f;
    f[kAt] = u == at ? 1.0f : 0.0f;
    f[kHas] = s.buffer.data() != nullptr ? 1.0f : 0.0f;
    f[kExpects] = s.marked > 0 || s.unbounded ? 1.0f : 0.0f;
    f[kRan] = s.ran ? 1.0f : 0.0f;
  }
  float* global = flags + size_t(n) * kFlags;
  std::fill(global, global + kGlobals + pool_.planned() + 1, 0.0f);
  global[0] = done ? 1.0f : 0.0f;
  global[1] = failed ? 1.0f : 0.0f;
  global[2] = backward ? 1.0f : 0.0f;
  // Room by the time the round settles: the unit this hook is at is done by
  // then, as a rule (not for a unit that holds nested ones: a lent slot then).
  const bool at_done = at >= 0 && !units_[size_t(at)].own_slot && state_[size_t(at)].buffer.data() != nullptr;
  global[kGlobals + std::min(pool_.free_slots() + (at_done ? 1 : 0), pool_.planned())] = 1.0f;
}

UnitSchedule::Sums UnitSchedule::settle() {
  if (!posted_) return Sums{};
  const auto start = std::chrono::steady_clock::now();
  const std::shared_ptr<StreamEvent> posted = std::move(posted_);
  backend_.host_wait(*posted);
  round_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return decide();
}

UnitSchedule::Sums UnitSchedule::decide() {
  const int n = num_units();
  const float* flags = round_flags_.data_as<float>();
  const float* global = flags + size_t(n) * kFlags;
  Sums sums{flags, global[0], global[1], global[2] >= float(comm_.world_size())};
  while (sums.min_free < pool_.planned() && global[kGlobals + sums.min_free] == 0) ++sums.min_free;
  if (sums.failed > 0) {
    reset_after_failure(posted_failed_);
    if (!posted_failed_) {
      throw PeerFailed("zerocore: " + std::to_string(int(sums.failed)) + " other rank(s) failed during this " +
                       (in_backward_ ? "backward" : "forward") +
                       " (their errors say why); this rank stopped with them at the same point, so that no rank "
                       "waits for the others forever");
    }
    return sums;
  }
  const float world = float(comm_.world_size());
  for (int u = 0; u < n; ++u) {
    if (sums.at(u, kNeed) > 0) {
      participate(u, u == needed_ ? Join::kNeed : Join::kLend);
    } else if (units_[size_t(u)].own_slot && sums.at(u, kAt) > 0 && sums.at(u, kHas) < world) {
      participate(u, Join::kPrefetch);  // a buffer of its own: gathering it ahead costs no slot
    }
  }
  if (!sums.backward) {
    for (int u = 0; u < n; ++u) {
      if ((sums.at(u, kAt) > 0 || sums.at(u, kNeed) > 0) && !units_[size_t(u)].own_slot &&
          std::find(order_.begin(), order_.end(), u) == order_.end()) {
        order_.push_back(u);
      }
    }
  }
  prefetch(sums);
  if (sums.backward) finalize_grads(sums, false);
  // The rank's hook then fails as at any error of its own, and the others
  // hear of it in the round its failed pass posts next.
  if (unordered_) std::rethrow_exception(std::exchange(unordered_, nullptr));
  return sums;
}

void UnitSchedule::prefetch(const Sums& sums) {
  // Forward follows the last step's order; backward this step's, reversed.
  const std::vector<int>& order = sums.backward ? order_ : last_order_;
  const int n = int(order.size());
  auto at = [&](int i) { return sums.backward ? order[size_t(n - 1 - i)] : order[size_t(i)]; };
  int from = -1;  // the furthest unit a rank is at; -1: none of the pool's (the root, which encloses them all)
  for (int i = 0; i < n; ++i) {
    if (sums.at(at(i), kAt) > 0) from = i;
  }
  bool needs = false, pooled_need = false;
  for (int u = 0; u < num_units(); ++u) {
    needs = needs || sums.at(u, kNeed) > 0;
    pooled_need = pooled_need || (sums.at(u, kNeed) > 0 && !units_[size_t(u)].own_slot);
  }
  bool at_own = false;
  for (int u = 0; u < num_units(); ++u) at_own = at_own || (units_[size_t(u)].own_slot && sums.at(u, kAt) > 0);
  if (prefetch_bytes_ <= 0 || (from < 0 && !needs && !at_own)) return;
  // The pool holds the unit in use and the window after it. A rank that
  // needed a unit waits for this round and uses the furthest unit now; the
  // others settle it at their next hook, by when the unit after it is in use.
  const int in_use = from + (needs ? 0 : 1);
  const int window = pool_.planned() - (in_use >= 0 && in_use < n ? 1 : 0);
  // As many as the fullest rank has room for, less the slot a need just took.
  int room = sums.min_free - (pooled_need ? 1 : 0);
  const float world = float(comm_.world_size());
  for (int i = from + 1; i < std::min(n, in_use + 1 + window) && room > 0; ++i) {
    if (sums.at(at(i), kHas) < world) {
      participate(at(i), Join::kPrefetch);
      --room;
    }
  }
}

void UnitSchedule::finalize_grads(const Sums& sums, bool all) {
  for (int u = num_units() - 1; u >= 0; --u) {  // reduction order: the root, unit 0, last
    State& s = state_[size_t(u)];
    const bool ran = sums.at(u, kRan) > 0;
    if (s.final || !(all || (ran && sums.at(u, kExpects) == 0))) continue;
    s.final = true;
    if (reducer_ == nullptr) continue;
    if (ran) {
      reducer_->reduce_groups(reduce_groups_[size_t(u)]);
    } else {
      reducer_->skip_groups(reduce_groups_[size_t(u)]);  // no rank has grads: nothing to reduce
    }
  }
}

void UnitSchedule::join(bool failed, bool backward) {
  finish_join();
  if (aborted_ || settle().failed > 0) return;
  post(-1, -1, true, failed, backward);
  ++blocking_rounds_;
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
    if (sums.done >= float(comm_.world_size())) return end_pass(sums, backward);
    post(-1, -1, true, failed, backward);
    ++blocking_rounds_;
  }
}

void UnitSchedule::end_pass(const Sums& sums, bool backward) {
  // Every rank is at this same round: the pass is over everywhere. A unit
  // with a buffer of its own (the root) stays gathered from its forward to
  // the end of its backward.
  for (int u = 0; u < num_units(); ++u) {
    State& s = state_[size_t(u)];
    s.held = false;
    s.open_backwards = 0;
    s.marks.clear();
    if (backward || !units_[size_t(u)].own_slot) release(u);
  }
  if (backward) {
    finalize_grads(sums, true);
    for (State& s : state_) {
      s.final = s.unbounded = s.ran = false;
      s.marked = 0;
    }
  }
}

void UnitSchedule::reset_after_failure(bool failed_here) {
  // Every rank settles this same round: each drops all it gathered.
  for (int u = 0; u < num_units(); ++u) {
    State& s = state_[size_t(u)];
    try {
      wait(u);
    } catch (...) {  // a gather that failed: the failure being raised already says why
    }
    if (s.slot >= 0) pool_.release(s.slot);
    s = State{};
  }
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
  const bool pooled_held = std::any_of(state_.begin(), state_.end(), [](const State& s) { return s.held && s.slot >= 0; });
  if (units_[size_t(unit)].own_slot && gathered(unit) && pooled_held) return hold(unit);
  settle();
  if (gathered(unit)) {
    post(-1, unit, false, false, in_backward_);  // settled at the next hook, while this unit computes
  } else {
    needed_ = unit;
    post(unit, unit, false, false, in_backward_);
    ++blocking_rounds_;
    settle();  // the round that gathers it: wait for it now
    needed_ = -1;
    post(-1, unit, false, false, in_backward_);  // and one for the next hook to settle: its prefetch
  }
  return hold(unit);
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
  Tensor buffer = acquire(unit);
  State& s = state_[size_t(unit)];
  s.marks.push_back(marks_post_backward);
  if (marks_post_backward) ++s.marked;
  declare_read(unit, "forward reads its params");
  return bind(unit, buffer);
}

UnitSchedule::Binding UnitSchedule::post_forward(int unit, bool backward_follows) {
  check(unit);
  declare_read(unit, "forward ends reading its params");
  State& s = state_[size_t(unit)];
  const bool marked = !s.marks.empty() && s.marks.back();
  if (!s.marks.empty()) s.marks.pop_back();
  if (backward_follows) {
    s.ran = true;
    if (!marked) s.unbounded = true;  // its grads come, but no post-backward point tells when they are complete
  }
  // In backward: a recomputation, held until its post-backward point. A
  // unit with a buffer of its own (the root, whose forward ends last and
  // whose backward starts first) stays gathered for its backward.
  if (!in_backward_) {
    s.held = false;
    if (!units_[size_t(unit)].own_slot) release(unit);
  }
  return Binding{Tensor(), false, take_released()};
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
  State& s = state_[size_t(unit)];
  ++s.open_backwards;
  s.ran = true;
  Tensor buffer = acquire(unit);
  declare_read(unit, "backward reads its params");
  return bind(unit, buffer);
}

UnitSchedule::Binding UnitSchedule::post_backward(int unit) {
  check(unit);
  declare_read(unit, "backward ends reading its params");
  State& s = state_[size_t(unit)];
  s.marked = std::max(0, s.marked - 1);
  s.open_backwards = std::max(0, s.open_backwards - 1);
  if (s.open_backwards == 0) {
    s.held = false;
    release(unit);
  }
  return Binding{Tensor(), false, take_released()};
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
  post(-1, -1, true, false, false);
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
  const auto own = std::find_if(units_.begin(), units_.end(), [](const UnitSpec& u) { return u.own_slot; });
  return own == units_.end() ? -1 : int(own - units_.begin());
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
  post(-1, root(), false, false, false);
  ++blocking_rounds_;
  settle();
}

int64_t UnitSchedule::step_round_width() const { return root() < 0 ? 0 : round_flags_.numel(); }

std::vector<float> UnitSchedule::step_round_flags() {
  release_all();
  if (root() < 0) return {};
  fill_flags(-1, root(), false, false, false);
  const float* flags = round_flags_.data_as<float>();
  return std::vector<float>(flags, flags + round_flags_.numel());
}

void UnitSchedule::end_step(const std::vector<float>& summed) {
  next_order();
  release_all();  // units gathered since the flags were taken (a whole-model view) held the old params
  if (int64_t(summed.size()) != step_round_width()) {
    throw InvalidArgument("UnitSchedule::end_step: " + std::to_string(summed.size()) + " summed flags for a round of " +
                          std::to_string(step_round_width()));
  }
  if (summed.empty()) return;
  std::copy(summed.begin(), summed.end(), round_flags_.data_as<float>());
  posted_failed_ = false;
  ++rounds_;
  decide();  // the sums are here already: nothing to wait for
}

void UnitSchedule::release_all() {
  finish_join();
  settle();
  for (int u = 0; u < num_units(); ++u) {
    if (!state_[size_t(u)].held) release(u);
  }
}

void UnitSchedule::gather_into(int unit, const Tensor& out) {
  check(unit);
  if (out.dtype() != dtype_ || out.numel() != unit_elems_[size_t(unit)]) {
    throw InvalidArgument("UnitSchedule::gather_into: out must be " + std::to_string(unit_elems_[size_t(unit)]) +
                          " elements of " + dtype_name(dtype_));
  }
  for (auto& e : issue(unit, out, false)) backend_.host_wait(*e);
  if (unordered_) std::rethrow_exception(std::exchange(unordered_, nullptr));
}

}  // namespace zerocore
