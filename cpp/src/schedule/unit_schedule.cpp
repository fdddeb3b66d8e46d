#include "zerocore/unit_schedule.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

UnitSchedule::UnitSchedule(CommQueue& comm, std::vector<UnitSpec> units, DType dtype, int64_t prefetch_bytes,
                           GradsFinal grads_final)
    : comm_(comm), units_(std::move(units)), own_(units_.size()), state_(units_.size()),
      prefetch_bytes_(prefetch_bytes), dtype_(dtype), elem_bytes_(dtype_size(dtype)),
      grads_final_(std::move(grads_final)) {
  int64_t largest = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    int64_t elems = 0;
    group_offsets_.emplace_back();
    for (const UnitGroup& g : units_[u].groups) {
      if (g.shard.dtype() != dtype || g.shard.numel() != g.plan.partition_elems()) {
        throw InvalidArgument("UnitSchedule: unit " + std::to_string(u) + ", group " + std::to_string(g.tag) +
                              ": the shard must be " + std::to_string(g.plan.partition_elems()) + " elements of " +
                              dtype_name(dtype));
      }
      group_offsets_.back().push_back(elems);
      elems += g.plan.total_elems();  // a multiple of world x alignment: the next group stays aligned
    }
    unit_elems_.push_back(elems);
    if (units_[u].own_slot) {
      own_[u] = Tensor::empty({elems}, dtype);
    } else {
      largest = std::max(largest, elems);
    }
  }
  // The unit in use and the prefetch window (the next unit always, more
  // while they fit in prefetch_bytes), and never more than there are units.
  const int64_t slot_bytes = std::max<int64_t>(1, largest * int64_t(elem_bytes_));
  const int64_t window = prefetch_bytes <= 0 ? 0 : std::max<int64_t>(1, prefetch_bytes / slot_bytes);
  const int64_t pooled = std::count_if(units_.begin(), units_.end(), [](const UnitSpec& u) { return !u.own_slot; });
  pool_ = SlotPool(dtype, largest, int(std::min(1 + window, pooled)));
  // A control buffer, not an arena: it is no communication buffer of the plan.
  auto flags = std::make_shared<std::vector<float>>(units_.size() * kFlags + 2);
  round_flags_ = Tensor(flags->data(), DType::kFloat32, Device{}, {int64_t(flags->size())}, flags);
}

UnitSchedule::~UnitSchedule() {
  for (State& s : state_) {
    for (auto& e : s.pending) {
      try {
        e->wait();
      } catch (...) {  // the queue's error was raised to whoever waited first
      }
    }
  }
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

std::vector<std::shared_ptr<Event>> UnitSchedule::issue(int unit, const Tensor& out, bool counted) {
  std::vector<std::shared_ptr<Event>> events;
  const UnitSpec& spec = units_[size_t(unit)];
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const UnitGroup& group = spec.groups[g];
    const int64_t base = group_offsets_[size_t(unit)][g];
    for (int b = 0; b < int(group.plan.buckets().size()); ++b) {
      const Bucket& bucket = group.plan.buckets()[size_t(b)];
      const CollectiveKey key{CollectiveKind::kAllGather, group.tag, b, bucket.numel};
      events.push_back(comm_.all_gather(
          key, group.shard.slice(group.plan.partition_offset(b), group.plan.shard_elems(b)),
          out.slice(base + bucket.offset, bucket.numel), counted));
    }
  }
  return events;
}

bool UnitSchedule::gather(int unit, bool must, const Sums& sums) {
  State& s = state_[size_t(unit)];
  if (s.buffer.data() != nullptr) return true;
  if (units_[size_t(unit)].own_slot) {
    s.buffer = own_[size_t(unit)];
  } else {
    int slot = pool_.try_acquire();
    if (slot < 0 && !must) return false;
    if (slot < 0) slot = evict_prefetched(sums);
    if (slot < 0) slot = pool_.acquire();  // more units in use at once than planned: the pool grows
    s.slot = slot;
    s.buffer = pool_.slot(slot).slice(0, unit_elems_[size_t(unit)]);
  }
  s.pending = issue(unit, s.buffer, true);
  return true;
}

int UnitSchedule::evict_prefetched(const Sums& sums) {
  for (int u = 0; u < num_units(); ++u) {
    State& s = state_[size_t(u)];
    if (s.slot >= 0 && sums.at(u, kHeld) == 0 && sums.at(u, kNeed) == 0) {
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
  std::vector<std::shared_ptr<Event>> pending;
  pending.swap(s.pending);
  for (auto& e : pending) e->wait();
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

void UnitSchedule::unhold(int unit) {
  State& s = state_[size_t(unit)];
  if (s.held) s.finished = true;
  s.held = false;
}

// Rounds ----------------------------------------------------------------------

UnitSchedule::Sums UnitSchedule::round(int need, bool done, bool failed) {
  const int n = num_units();
  float* flags = round_flags_.data_as<float>();
  for (int u = 0; u < n; ++u) {
    const State& s = state_[size_t(u)];
    float* f = flags + size_t(u) * kFlags;
    f[kNeed] = u == need ? 1.0f : 0.0f;
    f[kHeld] = s.held ? 1.0f : 0.0f;
    f[kFinished] = s.finished ? 1.0f : 0.0f;
    f[kExpects] = s.marked > 0 || s.unbounded ? 1.0f : 0.0f;
    f[kRan] = s.ran ? 1.0f : 0.0f;
  }
  flags[size_t(n) * kFlags] = done ? 1.0f : 0.0f;
  flags[size_t(n) * kFlags + 1] = failed ? 1.0f : 0.0f;
  const auto start = std::chrono::steady_clock::now();
  comm_.all_reduce(CollectiveKey{CollectiveKind::kAllReduce, -1, 0, round_flags_.numel()}, round_flags_)->wait();
  round_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ++rounds_;
  Sums sums{std::vector<float>(flags, flags + size_t(n) * kFlags), flags[size_t(n) * kFlags],
            flags[size_t(n) * kFlags + 1]};
  for (State& s : state_) s.finished = false;
  if (sums.failed > 0) {
    reset_after_failure(failed);
    if (!failed) {
      throw PeerFailed("zerocore: " + std::to_string(int(sums.failed)) + " other rank(s) failed during this " +
                       (in_backward_ ? "backward" : "forward") +
                       " (their errors say why); this rank stopped with them at the same point, so that no rank "
                       "waits for the others forever");
    }
    return sums;
  }
  release_finished(sums);
  for (int u = 0; u < n; ++u) {
    if (sums.at(u, kNeed) > 0) gather(u, true, sums);
  }
  if (!in_backward_) {
    for (int u = 0; u < n; ++u) {
      if (sums.at(u, kNeed) > 0 && std::find(order_.begin(), order_.end(), u) == order_.end()) order_.push_back(u);
    }
  }
  prefetch(sums);
  if (in_backward_) finalize_grads(sums, false);
  return sums;
}

void UnitSchedule::release_finished(const Sums& sums) {
  for (int u = 0; u < num_units(); ++u) {
    if (sums.at(u, kFinished) > 0 && sums.at(u, kHeld) == 0 && sums.at(u, kNeed) == 0) release(u);
  }
}

void UnitSchedule::prefetch(const Sums& sums) {
  if (prefetch_bytes_ <= 0) return;
  // Forward follows the last step's order; backward this step's, reversed.
  const std::vector<int>& order = in_backward_ ? order_ : last_order_;
  const int n = int(order.size());
  auto at = [&](int i) { return in_backward_ ? order[size_t(n - 1 - i)] : order[size_t(i)]; };
  int from = -1;  // the furthest unit needed now
  for (int i = 0; i < n; ++i) {
    if (sums.at(at(i), kNeed) > 0) from = i;
  }
  if (from < 0) return;
  int64_t budget = prefetch_bytes_;
  for (int i = from + 1; i < n; ++i) {
    const int64_t bytes = unit_elems_[size_t(at(i))] * int64_t(elem_bytes_);
    if (i != from + 1 && bytes > budget) break;
    budget -= bytes;
    if (!gather(at(i), false, sums)) break;
  }
}

void UnitSchedule::finalize_grads(const Sums& sums, bool all) {
  for (int u = num_units() - 1; u >= 0; --u) {  // reduction order: the root, unit 0, last
    State& s = state_[size_t(u)];
    const bool ran = sums.at(u, kRan) > 0;
    if (s.final || !(all || (ran && sums.at(u, kExpects) == 0))) continue;
    s.final = true;
    if (grads_final_) grads_final_(u, ran);
  }
}

void UnitSchedule::join(bool failed, bool backward) {
  Sums sums;
  do {
    sums = round(-1, true, failed);
    if (sums.failed > 0) return;
  } while (sums.done < float(comm_.world_size()));
  // Every rank is at this same round: the pass is over everywhere.
  for (int u = 0; u < num_units(); ++u) {
    State& s = state_[size_t(u)];
    s.held = false;
    s.open_backwards = 0;
    s.marks.clear();
    release(u);
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
  // Every rank is at this same round: each drops all it gathered.
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
  aborted_ = !failed_here;  // this rank throws; its end_forward/end_backward then has nothing to join
}

// Hooks -----------------------------------------------------------------------

Tensor UnitSchedule::pre_forward(int unit, bool marks_post_backward) {
  check(unit);
  if (!in_backward_ && !in_forward_) {
    in_forward_ = true;
    aborted_ = false;
  }
  round(unit, false, false);
  State& s = state_[size_t(unit)];
  s.marks.push_back(marks_post_backward);
  if (marks_post_backward) ++s.marked;
  return hold(unit);
}

void UnitSchedule::post_forward(int unit, bool backward_follows) {
  check(unit);
  State& s = state_[size_t(unit)];
  const bool marked = !s.marks.empty() && s.marks.back();
  if (!s.marks.empty()) s.marks.pop_back();
  if (backward_follows) {
    s.ran = true;
    if (!marked) s.unbounded = true;  // its grads come, but no post-backward point tells when they are complete
  }
  if (!in_backward_) unhold(unit);  // in backward: a recomputation, held until its post-backward point
}

void UnitSchedule::begin_backward() { in_backward_ = true; }

Tensor UnitSchedule::pre_backward(int unit) {
  check(unit);
  State& s = state_[size_t(unit)];
  ++s.open_backwards;
  s.ran = true;
  round(unit, false, false);
  return hold(unit);
}

void UnitSchedule::post_backward(int unit) {
  check(unit);
  State& s = state_[size_t(unit)];
  s.marked = std::max(0, s.marked - 1);
  s.open_backwards = std::max(0, s.open_backwards - 1);
  if (s.open_backwards == 0) unhold(unit);
}

void UnitSchedule::end_forward(bool failed) {
  if (in_backward_) return;
  if (aborted_) {
    aborted_ = false;
    return;
  }
  if (!in_forward_ && !failed) return;  // ended already
  join(failed, false);
  in_forward_ = false;
}

void UnitSchedule::end_backward(bool failed) {
  if (aborted_) {
    aborted_ = false;
  } else {
    join(failed, true);
  }
  in_backward_ = false;
}

void UnitSchedule::end_step() {
  if (!order_.empty()) last_order_.swap(order_);
  order_.clear();
}

void UnitSchedule::gather_into(int unit, const Tensor& out) {
  check(unit);
  if (out.dtype() != dtype_ || out.numel() != unit_elems_[size_t(unit)]) {
    throw InvalidArgument("UnitSchedule::gather_into: out must be " + std::to_string(unit_elems_[size_t(unit)]) +
                          " elements of " + dtype_name(dtype_));
  }
  for (auto& e : issue(unit, out, false)) e->wait();
}

}  // namespace zerocore
