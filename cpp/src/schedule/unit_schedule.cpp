#include "zerocore/unit_schedule.h"

#include <algorithm>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

UnitSchedule::UnitSchedule(CommQueue& comm, std::vector<UnitSpec> units, DType dtype, int64_t prefetch_bytes)
    : comm_(comm), units_(std::move(units)), own_(units_.size()), state_(units_.size()),
      prefetch_bytes_(prefetch_bytes), dtype_(dtype), elem_bytes_(dtype_size(dtype)) {
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

bool UnitSchedule::gather(int unit, bool must) {
  State& s = state_[size_t(unit)];
  if (s.buffer.data() != nullptr) return true;
  if (units_[size_t(unit)].own_slot) {
    s.buffer = own_[size_t(unit)];
  } else {
    int slot = pool_.try_acquire();
    if (slot < 0 && !must) return false;
    if (slot < 0) slot = evict_prefetched();
    if (slot < 0) slot = pool_.acquire();  // more units in use at once than planned: the pool grows
    s.slot = slot;
    s.buffer = pool_.slot(slot).slice(0, unit_elems_[size_t(unit)]);
  }
  s.pending = issue(unit, s.buffer, true);
  return true;
}

int UnitSchedule::evict_prefetched() {
  for (int u = 0; u < num_units(); ++u) {
    State& s = state_[size_t(u)];
    if (s.slot >= 0 && !s.held) {
      const int slot = s.slot;
      wait(u);
      s = State{};
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
  s = State{};
}

Tensor UnitSchedule::hold(int unit) {
  gather(unit, true);
  wait(unit);
  State& s = state_[size_t(unit)];
  s.held = true;
  return s.buffer;
}

template <class It>
void UnitSchedule::prefetch_after(int unit, It begin, It end) {
  const It at = std::find(begin, end, unit);
  if (at == end || prefetch_bytes_ <= 0) return;
  int64_t budget = prefetch_bytes_;
  for (It next = at + 1; next != end; ++next) {
    const int64_t bytes = unit_elems_[size_t(*next)] * int64_t(elem_bytes_);
    if (next != at + 1 && bytes > budget) break;
    budget -= bytes;
    if (!gather(*next, false)) break;
  }
}

Tensor UnitSchedule::pre_forward(int unit) {
  check(unit);
  Tensor buffer = hold(unit);
  if (!in_backward_) {
    if (std::find(forward_order_.begin(), forward_order_.end(), unit) == forward_order_.end()) {
      forward_order_.push_back(unit);
    }
    prefetch_after(unit, last_forward_order_.begin(), last_forward_order_.end());
  }
  return buffer;
}

void UnitSchedule::post_forward(int unit) {
  check(unit);
  if (!in_backward_) release(unit);  // in backward: a recomputation, released at its post-backward point
}

void UnitSchedule::begin_backward() { in_backward_ = true; }

Tensor UnitSchedule::pre_backward(int unit) {
  check(unit);
  ++state_[size_t(unit)].open_backwards;
  Tensor buffer = hold(unit);
  prefetch_after(unit, forward_order_.rbegin(), forward_order_.rend());  // backward runs forward's order reversed
  return buffer;
}

void UnitSchedule::post_backward(int unit) {
  check(unit);
  State& s = state_[size_t(unit)];
  s.open_backwards = std::max(0, s.open_backwards - 1);
  if (s.open_backwards == 0) release(unit);
}

void UnitSchedule::end_forward() {
  if (in_backward_) return;
  for (int u = 0; u < num_units(); ++u) release(u);
}

void UnitSchedule::end_backward() {
  for (int u = 0; u < num_units(); ++u) release(u);
  in_backward_ = false;
}

void UnitSchedule::end_step() {
  if (!forward_order_.empty()) last_forward_order_.swap(forward_order_);
  forward_order_.clear();
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
