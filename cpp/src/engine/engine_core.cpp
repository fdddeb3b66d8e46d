#include "zerocore/engine/engine_core.h"

#include <algorithm>
#include <string>
#include <utility>

#include "zerocore/error.h"

namespace zerocore {

namespace {

[[noreturn]] void refuse(const std::string& what) { throw InvalidArgument("EngineCore: " + what); }

std::string group_name(int index, const EngineCore::Group& g) {
  return "group " + std::to_string(index) + " (tag " + std::to_string(g.tag) + ")";
}

// What a store placed for `stage` keeps; empty when it does, else what differs.
std::string placement_problem(const StorePlacement& p, int stage, bool offloaded) {
  if (p.trainable && p.partitions_grads != (stage >= 2)) {
    return std::string("its store ") + (p.partitions_grads ? "partitions" : "does not partition") + " the grads";
  }
  if (p.sharded && stage != 3) return "its store shards the params";
  if (p.trainable && p.optimizer_on_host != offloaded) {
    return std::string("its store keeps the optimizer ") +
           (p.optimizer_on_host ? "on the host" : "where training runs") + ", the core " +
           (offloaded ? "has an" : "has no") + " offload optimizer";
  }
  return {};
}

// Staging buffers of gradient reduction: those of the reductions in
// flight (completed only when a bucket needs a buffer and none is free,
// BucketReducer), plus the buckets open at once when grads arrive in about
// plan order. Stage 2: those one param spans, and one more for a neighbour
// that comes early (or the next bucket, which takes its staging for its
// grad views as the one before goes out). Stage 3, where a unit's buckets
// hold its grad views: the root's buckets (open all backward) and three of
// the largest other unit's. A unit is reduced only once the ranks agree it
// is done, in the round the next unit's backward posts, settled one unit
// later: at the start of the backward of the unit after that, which takes
// its grad views right then. So the staging holds the unit whose grads
// accumulate, the unit waiting for its round and the reduction just issued,
// which runs behind that backward; the unit after finds the three taken and
// completes the oldest, which has run behind a whole unit's backward. With
// two, every unit's backward began by waiting for the reduce-scatter issued
// at its start (tests/test_reduction_overlap.py). Config(deterministic=True)
// keeps two: its staging is int64, twice fp32's bytes, so three units would
// hold twice the default's staging (its 1.1x memory target,
// docs/deterministic.md); its units take staging at their first grad, not
// at their backward's start (no grad views), so the wait is what is left of
// that reduce-scatter then.
int staging_for(const EngineCore::Description& d) {
  auto trainable = [&](int i) { return d.groups[size_t(i)].store->placement().trainable; };
  if (d.stage == 2) {
    std::optional<int> span;  // the most buckets a param spans (an empty one: none)
    for (int i = 0; i < int(d.groups.size()); ++i) {
      if (!trainable(i)) continue;
      for (const ParamSlot& s : d.groups[size_t(i)].store->plan().params()) {
        span = std::max(span.value_or(0), s.last_bucket - s.first_bucket + 1);
      }
    }
    return 2 + span.value_or(1);
  }
  std::vector<int> buckets;  // per unit, its trainable groups'
  for (const EngineCore::Unit& u : d.units) {
    int n = 0;
    for (int i : u.groups) n += trainable(i) ? int(d.groups[size_t(i)].store->plan().buckets().size()) : 0;
    buckets.push_back(n);
  }
  if (buckets.empty()) return 0;
  bool exact = false;
  for (const EngineCore::Group& g : d.groups) exact = exact || g.reduced.data() != nullptr;
  const int units = exact ? 2 : 3;
  return buckets[0] + units * (buckets.size() > 1 ? *std::max_element(buckets.begin() + 1, buckets.end()) : 0);
}

}  // namespace

EngineCore::EngineCore(const Description& d)
    : description_(d), stage_(d.stage), order_(d.reduction_order) {
  check(d);
  const std::vector<Group>& groups = description_.groups;
  const Queues& queues = description_.queues;
  staging_buffers_ = d.stage >= 2 ? d.staging_buffers.value_or(staging_for(d)) : 0;
  std::vector<int> trainable;
  for (int i = 0; i < int(groups.size()); ++i) {
    if (groups[size_t(i)].store->placement().trainable) trainable.push_back(i);
  }
  if (!trainable.empty()) {
    const Group& first = groups[size_t(trainable.front())];
    reduce_dtype_ = first.store->placement().reduce_dtype;
    exact_ = first.reduced.data() != nullptr;
  }
  if (order_.empty()) {
    for (int i : trainable) order_.push_back({i, groups[size_t(i)].tag});
  }
  if (stage_ <= 1) {
    std::vector<FlatGroupBuffer> grads;
    for (int i : trainable) {
      const Group& g = groups[size_t(i)];
      FlatGroupBuffer b = g.store->group_buffer(g.tag, "grad_full");
      if (exact_) b.buffer = g.reduced;
      grads.push_back(std::move(b));
    }
    grad_reduce_ = std::make_unique<BucketCollectives>(
        *queues.data, stage_ == 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce, std::move(grads));
  }
  if (stage_ >= 1) {  // the groups kept whole (at stage 3, those under the persist threshold)
    std::vector<FlatGroupBuffer> full;
    for (int i : trainable) {
      const Group& g = groups[size_t(i)];
      if (!g.store->placement().sharded) full.push_back(g.store->group_buffer(g.tag, "full"));
    }
    if (!full.empty()) param_gather_ = std::make_unique<BucketCollectives>(*queues.data, CollectiveKind::kAllGather,
                                                                           std::move(full));
  }
  if (stage_ >= 2) build_reducer();
  if (stage_ == 3) {
    // Each unit's trainable groups, by their places in the reduction
    // order as built: the places stay when a test reorders.
    std::vector<int> place(groups.size(), -1);
    for (int k = 0; k < int(order_.size()); ++k) place[size_t(order_[size_t(k)].group)] = k;
    std::vector<UnitSpec> specs;
    DType dtype = DType::kFloat32;
    for (const Unit& u : d.units) {
      UnitSpec spec{{}, u.own_slot};
      std::vector<int>& places = unit_places_.emplace_back();
      for (int i : u.groups) {
        const Group& g = groups[size_t(i)];
        dtype = g.store->placement().dtype;
        spec.groups.push_back(g.store->group_buffer(g.tag, "shard"));
        if (place[size_t(i)] >= 0) places.push_back(place[size_t(i)]);
      }
      specs.push_back(std::move(spec));
    }
    schedule_ = std::make_unique<UnitSchedule>(*queues.data, *queues.rounds, std::move(specs), dtype,
                                               d.prefetch_bytes);
    schedule_->set_grad_reducer(reducer_.get(), unit_places_);
  }
  if (d.offload != nullptr) {
    bool swaps = false;
    for (int i : trainable) swaps = swaps || groups[size_t(i)].store->swaps_grads();
    host_update_ = std::make_unique<HostUpdate>(*d.offload, swaps, d.delays_from);
  }
  ZeroStep::Parts parts;
  parts.data = queues.data;
  parts.control = queues.control;
  if (!host_update_) {
    for (int i : trainable) {
      const std::vector<FlatRun> runs = groups[size_t(i)].store->flat_runs();
      parts.runs.insert(parts.runs.end(), runs.begin(), runs.end());
    }
  }
  parts.partitioned = stage_ >= 1;
  // Config(deterministic=True) at stages 0-1: the caller reduces the exact sums, then scales them into the grads.
  parts.grad_reduce = exact_ ? nullptr : grad_reduce_.get();
  parts.param_gather = param_gather_.get();
  parts.grad_reducer = reducer_.get();
  parts.units = schedule_.get();
  parts.loss_scaler = d.loss_scaler;
  parts.host_update = host_update_.get();
  parts.reductions = stage_ >= 2 ? queues.reductions : nullptr;
  step_ = std::make_unique<ZeroStep>(std::move(parts));
}

EngineCore::~EngineCore() = default;

void EngineCore::check(const Description& d) const {
  if (d.stage < 0 || d.stage > 3) refuse("stage " + std::to_string(d.stage) + "; ZeRO's stages are 0, 1, 2 and 3");
  if (d.queues.data == nullptr) refuse("no data queue (Queues::data)");
  if (d.queues.control == nullptr) refuse("no control queue (Queues::control) for the step's exchange");
  if (d.stage == 3 && d.queues.rounds == nullptr) refuse("stage 3 needs a queue for its rounds (Queues::rounds)");
  if (d.offload != nullptr && d.stage == 0) {
    refuse("an offload optimizer at stage 0; ZeRO-Offload updates a partition (stages 1-3)");
  }
  if (d.staging_buffers && *d.staging_buffers < 0) {
    refuse("staging_buffers " + std::to_string(*d.staging_buffers) + "; at least 0");
  }
  const bool offloaded = d.offload != nullptr;
  int exact = -1;  // whether the trainable groups' grads are reduced elsewhere (the first's say)
  std::optional<DType> reduce_dtype;
  for (int i = 0; i < int(d.groups.size()); ++i) {
    const Group& g = d.groups[size_t(i)];
    if (g.store == nullptr) refuse(group_name(i, g) + " has no store");
    if (!g.store->allocated()) refuse(group_name(i, g) + "'s store is not allocated (PartitionStore::allocate)");
    const StorePlacement& p = g.store->placement();
    const int world = g.store->plan().world_size();
    if (d.stage == 0 && world != 1) {
      refuse(group_name(i, g) + "'s plan partitions over " + std::to_string(world) +
             " ranks; at stage 0 every rank updates all of it (a plan of world size 1)");
    }
    if (d.stage >= 1 && world != d.queues.data->world_size()) {
      refuse(group_name(i, g) + "'s plan partitions over " + std::to_string(world) + " ranks, the data queue has " +
             std::to_string(d.queues.data->world_size()));
    }
    const std::string problem = placement_problem(p, d.stage, offloaded);
    if (!problem.empty()) refuse(group_name(i, g) + ": " + problem + ", unlike stage " + std::to_string(d.stage));
    if (!p.trainable) {
      if (g.reduced.data() != nullptr) refuse(group_name(i, g) + " is frozen; it has no grads to reduce elsewhere");
      continue;
    }
    if (reduce_dtype && *reduce_dtype != p.reduce_dtype) {
      refuse(group_name(i, g) + " reduces in " + dtype_name(p.reduce_dtype) + ", an earlier group in " +
             dtype_name(*reduce_dtype) + "; one reduce dtype for all");
    }
    reduce_dtype = p.reduce_dtype;
    const bool reduced = g.reduced.data() != nullptr;
    if (exact >= 0 && reduced != bool(exact)) {
      refuse(group_name(i, g) + (reduced ? " has" : " has no") + " buffer to reduce into (Group::reduced), unlike " +
             "an earlier trainable group; all or none");
    }
    exact = reduced;
    const int64_t grad_elems = g.store->buffer(d.stage >= 2 ? "grad_part" : "grad_full").numel();
    if (reduced && g.reduced.numel() != grad_elems) {
      refuse(group_name(i, g) + "'s buffer to reduce into (Group::reduced) has " + std::to_string(g.reduced.numel()) +
             " elements, its grads " + std::to_string(grad_elems));
    }
  }
  if (d.stage != 3 && !d.units.empty()) {
    refuse(std::to_string(d.units.size()) + " units at stage " + std::to_string(d.stage) + "; only stage 3 has units");
  }
  std::vector<int> unit_of(d.groups.size(), -1);
  std::optional<DType> unit_dtype;
  for (int u = 0; u < int(d.units.size()); ++u) {
    for (int i : d.units[size_t(u)].groups) {
      if (i < 0 || i >= int(d.groups.size())) {
        refuse("unit " + std::to_string(u) + " names group " + std::to_string(i) + " of " +
               std::to_string(d.groups.size()));
      }
      if (unit_of[size_t(i)] >= 0) {
        refuse(group_name(i, d.groups[size_t(i)]) + " is in unit " + std::to_string(unit_of[size_t(i)]) +
               " and unit " + std::to_string(u) + "; a group belongs to one unit");
      }
      const StorePlacement& p = d.groups[size_t(i)].store->placement();
      if (unit_dtype && p.dtype != *unit_dtype) {
        refuse(group_name(i, d.groups[size_t(i)]) + " holds " + dtype_name(p.dtype) + ", an earlier unit group " +
               dtype_name(*unit_dtype) + "; the units' buffers hold one dtype");
      }
      unit_dtype = p.dtype;
      if (!p.sharded) {
        refuse("unit " + std::to_string(u) + " names " + group_name(i, d.groups[size_t(i)]) +
               ", whose store keeps its params whole; a unit gathers sharded groups");
      }
      unit_of[size_t(i)] = u;
    }
  }
  for (int i = 0; i < int(d.groups.size()); ++i) {
    if (d.groups[size_t(i)].store->placement().sharded && unit_of[size_t(i)] < 0) {
      refuse(group_name(i, d.groups[size_t(i)]) + " is sharded but in no unit, so nothing would gather it");
    }
  }
  if (!d.reduction_order.empty()) {
    if (d.stage < 2) refuse("a reduction order at stage " + std::to_string(d.stage) + "; only stages 2-3 have one");
    std::vector<bool> seen(d.groups.size(), false);
    size_t trainable = 0;
    for (const Group& g : d.groups) trainable += g.store->placement().trainable;
    for (const Reduced& r : d.reduction_order) {
      if (r.group < 0 || r.group >= int(d.groups.size()) ||
          !d.groups[size_t(r.group)].store->placement().trainable || seen[size_t(r.group)]) {
        refuse("the reduction order names group " + std::to_string(r.group) +
               ", which is not a trainable group named once; it names each trainable group once");
      }
      seen[size_t(r.group)] = true;
    }
    if (d.reduction_order.size() != trainable) {
      refuse("the reduction order names " + std::to_string(d.reduction_order.size()) + " groups, of " +
             std::to_string(trainable) + " trainable ones; it names each once");
    }
  }
}

void EngineCore::build_reducer() {
  std::vector<FlatGroupBuffer> parts;
  for (const Reduced& r : order_) {
    const Group& g = description_.groups[size_t(r.group)];
    FlatGroupBuffer b = g.store->group_buffer(r.tag, "grad_part");
    if (exact_) b.buffer = g.reduced;
    parts.push_back(std::move(b));
  }
  const Queues& queues = description_.queues;
  CommQueue& queue = queues.reductions != nullptr ? *queues.reductions : *queues.data;
  reducer_ = std::make_unique<BucketReducer>(queue, std::move(parts), exact_ ? DType::kInt64 : reduce_dtype_,
                                             staging_buffers_, /*on_request=*/stage_ == 3);
  partitions_stale_ = false;
}

void EngineCore::set_reduction_order(std::vector<Reduced> order) {
  if (order.empty()) refuse("set_reduction_order: an empty order; it names each trainable group once");
  Description d = description_;
  d.reduction_order = order;
  check(d);
  // The old reducer goes last: the step and the schedule hold it until they take the new one.
  std::unique_ptr<BucketReducer> old = std::move(reducer_);
  order_ = std::move(order);
  build_reducer();
  step_->set_grad_reducer(reducer_.get());
  if (schedule_) schedule_->set_grad_reducer(reducer_.get(), unit_places_);
}

std::vector<Tensor> EngineCore::grad_partitions() const {
  std::vector<Tensor> out;
  for (const Reduced& r : order_) out.push_back(description_.groups[size_t(r.group)].store->buffer("grad_part"));
  return out;
}

int64_t EngineCore::follow_swaps() {
  if (!host_update_) return 0;
  const int64_t now = host_update_->grad_swaps() - swaps_followed_;
  for (int64_t k = 0; k < now; ++k) {
    for (const Group& g : description_.groups) {
      if (g.store->placement().trainable && g.store->swaps_grads()) g.store->swap_grads();
    }
  }
  swaps_followed_ += now;
  // The int64 sums of an exact reduction do not swap.
  partitions_stale_ = partitions_stale_ || (now > 0 && reducer_ && !exact_);
  return now;
}

void EngineCore::before_backward() {
  if (!partitions_stale_) return;
  reducer_->set_grad_partitions(grad_partitions());
  partitions_stale_ = false;
}

const Exchanged& EngineCore::exchange(int64_t changes) {
  try {
    const Exchanged& out = step_->exchange(changes);
    follow_swaps();
    return out;
  } catch (...) {
    follow_swaps();
    throw;
  }
}

StepResult EngineCore::step(const StepOptions& options) {
  try {
    const StepResult out = step_->step(options);
    follow_swaps();
    return out;
  } catch (...) {
    follow_swaps();
    throw;
  }
}

}  // namespace zerocore
