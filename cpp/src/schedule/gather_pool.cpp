#include "zerocore/schedule/gather_pool.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "zerocore/error.h"
#include "zerocore/schedule/unit_schedule.h"

namespace zerocore {

GatherPool::GatherPool(CommQueue& comm, std::vector<UnitSpec> units, DType dtype, int64_t prefetch_bytes)
    : comm_(comm), backend_(comm.backend()), units_(std::move(units)), dtype_(dtype), own_(units_.size()),
      placed_(units_.size()) {
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
  const int64_t slot_bytes = std::max<int64_t>(1, largest * int64_t(dtype_size(dtype)));
  const int64_t window = prefetch_bytes <= 0 ? 0 : std::max<int64_t>(1, prefetch_bytes / slot_bytes);
  const int64_t pooled = std::count_if(units_.begin(), units_.end(), [](const UnitSpec& u) { return !u.own_slot; });
  pool_ = SlotPool(dtype, largest, int(std::min(1 + window, pooled)), backend_, MemoryKind::kDevice, "gathered units");
}

GatherPool::~GatherPool() {
  for (Placed& p : placed_) {
    for (auto& e : p.pending) {
      try {
        backend_.host_wait(*e);
      } catch (...) {  // the queue's error was raised to whoever waited first
      }
    }
  }
}

bool GatherPool::has_own_buffer(int unit) const { return units_[size_t(unit)].own_slot; }

bool GatherPool::holds_pooled() const {
  return std::any_of(placed_.begin(), placed_.end(),
                     [](const Placed& p) { return p.residency == Residency::kHeld && p.slot >= 0; });
}

size_t GatherPool::bytes() const {
  size_t bytes = pool_.bytes();
  for (const Tensor& t : own_) bytes += t.nbytes();
  return bytes;
}

std::vector<std::shared_ptr<StreamEvent>> GatherPool::issue(int unit, const Tensor& out, bool counted) {
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

void GatherPool::raise_unordered() {
  if (unordered_) std::rethrow_exception(std::exchange(unordered_, nullptr));
}

void GatherPool::participate(int unit, Join how) {
  Placed& p = placed_[size_t(unit)];
  const bool own = units_[size_t(unit)].own_slot;
  if (p.residency == Residency::kReleased && how != Join::kLend) {
    int slot = own ? -1 : pool_.try_acquire();
    if (!own && slot < 0 && how == Join::kNeed) slot = evict_prefetched();
    if (!own && slot < 0 && how == Join::kNeed) slot = pool_.acquire();  // more units at once than planned: grow
    if (own || slot >= 0) {
      advance(unit, p.residency, Residency::kGathering);
      p.slot = slot;
      p.buffer = own ? own_[size_t(unit)] : pool_.slot(slot).slice(0, unit_elems_[size_t(unit)]);
      p.pending = issue(unit, p.buffer, true);
      return;
    }
  }
  // Here already, not wanted, or no room: this rank only lends its shard,
  // into a slot that goes back once the gather has written it (a unit with
  // a buffer of its own is larger than a slot: a temporary one of the
  // backend's, freed once gathered into, a rare case).
  const int64_t elems = unit_elems_[size_t(unit)];
  const int lent = own ? -1 : pool_.acquire();
  const Tensor out = own ? Tensor::empty({elems}, dtype_, backend_, MemoryKind::kDevice,
                                         "unit " + std::to_string(unit) + " lent to a gather (temporary)")
                         : pool_.slot(lent).slice(0, elems);
  for (auto& e : issue(unit, out, true)) backend_.host_wait(*e);
  if (!own) pool_.release(lent);
}

int GatherPool::evict_prefetched() {
  for (int u = 0; u < num_units(); ++u) {
    Placed& p = placed_[size_t(u)];
    if (p.slot >= 0 && p.residency != Residency::kHeld) {
      const int slot = p.slot;
      wait(u);
      advance(u, p.residency, Residency::kReleased);
      p.slot = -1;
      p.buffer = Tensor();
      return slot;  // still taken: handed straight to the caller
    }
  }
  return -1;
}

void GatherPool::wait(int unit) {
  Placed& p = placed_[size_t(unit)];
  if (p.residency != Residency::kGathering) return;
  // Clear first: a failed gather is raised once, and the unit can still be released.
  advance(unit, p.residency, Residency::kGathered);
  std::vector<std::shared_ptr<StreamEvent>> pending;
  pending.swap(p.pending);
  // The compute stream reads the unit's params (and a released slot's next
  // gather is ordered behind compute by the comm stream's own wait).
  for (auto& e : pending) backend_.wait(backend_.compute_stream(), *e);
}

Tensor GatherPool::hold(int unit) {
  wait(unit);
  Placed& p = placed_[size_t(unit)];
  if (p.residency != Residency::kHeld) advance(unit, p.residency, Residency::kHeld);
  return p.buffer;
}

void GatherPool::let_go(int unit) {
  Placed& p = placed_[size_t(unit)];
  if (p.residency == Residency::kHeld) advance(unit, p.residency, Residency::kGathered);
}

void GatherPool::release(int unit) {
  Placed& p = placed_[size_t(unit)];
  if (p.residency == Residency::kReleased) return;
  wait(unit);  // the gather writes into the slot until its event
  advance(unit, p.residency, Residency::kReleased);
  if (p.slot >= 0) pool_.release(p.slot);
  p.slot = -1;
  p.buffer = Tensor();
}

void GatherPool::release_unheld() {
  for (int u = 0; u < num_units(); ++u) {
    if (residency(u) != Residency::kHeld) release(u);
  }
}

void GatherPool::drop_all() {
  for (int u = 0; u < num_units(); ++u) {
    try {
      wait(u);
    } catch (...) {  // a gather that failed: the failure being raised already says why
    }
    let_go(u);
    release(u);
  }
}

void GatherPool::declare_read(int unit, const char* what) {
  const Tensor& b = buffer(unit);
  if (b.data() == nullptr) return;
  backend_.declare_access(backend_.compute_stream(), Access::read(b), "unit " + std::to_string(unit) + "'s " + what);
}

void GatherPool::gather_into(int unit, const Tensor& out) {
  if (out.dtype() != dtype_ || out.numel() != unit_elems_[size_t(unit)]) {
    throw InvalidArgument("UnitSchedule::gather_into: out must be " + std::to_string(unit_elems_[size_t(unit)]) +
                          " elements of " + dtype_name(dtype_));
  }
  for (auto& e : issue(unit, out, false)) backend_.host_wait(*e);
  raise_unordered();
}

}  // namespace zerocore
