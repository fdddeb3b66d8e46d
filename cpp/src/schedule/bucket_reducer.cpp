#include "zerocore/schedule/bucket_reducer.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

BucketReducer::BucketReducer(CommQueue& comm, std::vector<FlatGroupBuffer> grad_parts, DType reduce_dtype,
                             int staging_buffers, bool on_request)
    : comm_(comm), backend_(comm.backend()), groups_(std::move(grad_parts)), reduce_dtype_(reduce_dtype),
      on_request_(on_request) {
  int64_t largest = 0;
  for (int g = 0; g < int(groups_.size()); ++g) {
    const FlatGroupBuffer& group = groups_[size_t(g)];
    const LayoutPlan& plan = group.plan;
    check_grad_part(group, group.buffer);
    if (plan.world_size() != comm.world_size()) {
      throw InvalidArgument("BucketReducer: group " + std::to_string(group.tag) + " is planned for " +
                            std::to_string(plan.world_size()) + " ranks, the queue has " +
                            std::to_string(comm.world_size()));
    }
    first_bucket_.push_back(int(buckets_.size()));
    pieces_.emplace_back(plan.params().size());
    reported_.emplace_back(plan.params().size());
    for (int b = 0; b < int(plan.buckets().size()); ++b) {
      const Bucket& bucket = plan.buckets()[size_t(b)];
      largest = std::max(largest, bucket.numel);
      BucketState state{g, b};
      for (int p = bucket.first_param; p <= bucket.last_param; ++p) {
        const ParamSlot& slot = plan.params()[size_t(p)];
        const int64_t lo = std::max(slot.offset, bucket.offset);
        const int64_t hi = std::min(slot.offset + slot.numel, bucket.offset + bucket.numel);
        if (hi <= lo) continue;
        pieces_[size_t(g)][size_t(p)].push_back(
            Piece{int(buckets_.size()), lo - slot.offset, lo - bucket.offset, hi - lo});
        reported_[size_t(g)][size_t(p)].push_back(false);
        ++state.params;
      }
      state.waiting = state.params;
      buckets_.push_back(state);
    }
  }
  pool_ = SlotPool(reduce_dtype, largest, largest > 0 ? staging_buffers : 0, backend_, MemoryKind::kDevice,
                   "grad staging");
  int64_t largest_host_shard = 0;
  for (const FlatGroupBuffer& group : groups_) {
    on_host_.push_back(on_host(group.buffer));
    for (int b = 0; on_host_.back() && b < int(group.plan.buckets().size()); ++b) {
      largest_host_shard = std::max(largest_host_shard, group.plan.shard_elems(b));
    }
  }
  if (largest_host_shard > 0) {
    down_ = &backend_.create_stream("grads down");
    landing_ = SlotPool(reduce_dtype, largest_host_shard, 1, backend_, MemoryKind::kHostPinned, "grad landing");
  }
}

bool BucketReducer::on_host(const Tensor& grad_part) const {
  const std::optional<MemoryKind> kind = backend_.kind_of(grad_part.data());
  return kind && *kind != MemoryKind::kDevice;
}

BucketReducer::~BucketReducer() {
  for (InFlight& f : in_flight_) {
    try {
      backend_.host_wait(*f.event);
    } catch (...) {  // the queue's error was raised to whoever waited first
    }
  }
  try {  // once the reducer is gone, nothing of its work touches the partitions
    if (down_) backend_.host_wait(*backend_.record(*down_));
  } catch (...) {  // NOLINT: an error of the adds was raised to whoever waited first
  }
}

void BucketReducer::check_grad_part(const FlatGroupBuffer& group, const Tensor& grad_part) const {
  // int64 reductions may add into int40 sums (a partition's, on the device: DType::kInt40).
  const bool narrow_sums = reduce_dtype_ == DType::kInt64 && grad_part.dtype() == DType::kInt40;
  if ((grad_part.dtype() != reduce_dtype_ && !narrow_sums) || grad_part.numel() != group.plan.partition_elems()) {
    throw InvalidArgument("BucketReducer: group " + std::to_string(group.tag) + ": grad_part must be " +
                          std::to_string(group.plan.partition_elems()) + " elements of " +
                          dtype_name(reduce_dtype_) + (reduce_dtype_ == DType::kInt64 ? " or int40" : ""));
  }
}

bool BucketReducer::between_backwards() const {
  if (!in_flight_.empty() || next_ != 0) return false;
  for (const BucketState& b : buckets_) {
    if (b.phase != BucketPhase::kEmpty || b.waiting != b.params) return false;
  }
  return true;
}

void BucketReducer::set_grad_partitions(const std::vector<Tensor>& grad_parts) {
  if (grad_parts.size() != groups_.size()) {
    throw InvalidArgument("BucketReducer.set_grad_partitions: " + std::to_string(grad_parts.size()) +
                          " partitions for " + std::to_string(groups_.size()) + " groups");
  }
  if (!between_backwards()) {
    throw InvalidArgument("BucketReducer.set_grad_partitions: a backward is under way (grads staged or "
                          "reductions in flight); change the partitions between backwards");
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    check_grad_part(groups_[g], grad_parts[g]);
    if (on_host(grad_parts[g]) != on_host_[g]) {
      throw InvalidArgument("BucketReducer.set_grad_partitions: group " + std::to_string(groups_[g].tag) +
                            "'s new partition is " + (on_host_[g] ? "device" : "host") +
                            " memory, the old one was not");
    }
  }
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].buffer = grad_parts[g];
}

const std::vector<BucketReducer::Piece>& BucketReducer::pieces(int group, int param) const {
  if (group < 0 || group >= int(groups_.size()) || param < 0 || param >= int(pieces_[size_t(group)].size())) {
    throw InvalidArgument("BucketReducer: no param " + std::to_string(param) + " in group index " +
                          std::to_string(group));
  }
  return pieces_[size_t(group)][size_t(param)];
}

void BucketReducer::advance_bucket(int index, BucketPhase to) {
  const BucketState& b = buckets_[size_t(index)];
  advance("bucket " + std::to_string(b.bucket) + " of group " + std::to_string(groups_[size_t(b.group)].tag),
          buckets_[size_t(index)].phase, to);
}

int BucketReducer::take_staging(int index) {
  BucketState& b = buckets_[size_t(index)];
  if (!holds_staging(b.phase)) {
    // A slot held by a reduction in flight comes back once it completes:
    // complete the oldest (as the next issue would) before adding a slot,
    // so the pool grows only for buckets open at once.
    int slot = pool_.try_acquire();
    while (slot < 0 && !in_flight_.empty()) {
      complete_oldest();
      slot = pool_.try_acquire();
    }
    b.staging = slot >= 0 ? slot : pool_.acquire();
    backend_.fill(backend_.compute_stream(), pool_.slot(b.staging), 0.0f);
    advance_bucket(index, b.phase == BucketPhase::kIssued ? BucketPhase::kLate : BucketPhase::kStaging);
  }
  return b.staging;
}

Tensor BucketReducer::view(int group, int param) {
  const std::vector<Piece>& ps = pieces(group, param);
  const ParamSlot& slot = groups_[size_t(group)].plan.params()[size_t(param)];
  if (ps.size() != 1 || ps[0].numel != slot.numel) return Tensor();
  if (issued(buckets_[size_t(ps[0].bucket)].phase)) return Tensor();
  return pool_.slot(take_staging(ps[0].bucket)).slice(ps[0].staging_offset, ps[0].numel);
}

std::vector<Tensor> BucketReducer::grad_views(int group) {
  if (group < 0 || group >= int(groups_.size())) {
    throw InvalidArgument("BucketReducer.grad_views: no group index " + std::to_string(group));
  }
  std::vector<Tensor> views;
  for (int p = 0; p < int(pieces_[size_t(group)].size()); ++p) views.push_back(view(group, p));
  return views;
}

void BucketReducer::open(int index, std::vector<GradView>& views) {
  BucketState& b = buckets_[size_t(index)];
  if (issued(b.phase) || b.viewed) return;
  b.viewed = true;
  const Bucket& bucket = groups_[size_t(b.group)].plan.buckets()[size_t(b.bucket)];
  for (int p = bucket.first_param; p <= bucket.last_param; ++p) {
    const std::vector<Piece>& ps = pieces_[size_t(b.group)][size_t(p)];
    if (ps.size() != 1 || ps[0].bucket != index || reported_[size_t(b.group)][size_t(p)][0]) continue;
    Tensor v = view(b.group, p);
    if (v.data() != nullptr) views.push_back(GradView{b.group, p, std::move(v)});
  }
}

std::vector<GradView> BucketReducer::begin_backward() {
  if (on_request_) {
    throw InvalidArgument("BucketReducer.begin_backward: this reducer issues on request (stage 3), where a unit's "
                          "schedule says when; take each group's views before its backward (grad_views)");
  }
  hands_out_views_ = true;
  std::vector<GradView> views;
  if (next_ < buckets_.size()) open(int(next_), views);
  return views;
}

std::vector<GradView> BucketReducer::grad_ready(int group, int param, const Tensor& grad,
                                                const std::optional<Grid>& grid) {
  const std::vector<Piece>& ps = pieces(group, param);
  const int64_t numel = groups_[size_t(group)].plan.params()[size_t(param)].numel;
  if (grad.numel() != numel) {
    throw InvalidArgument("BucketReducer: the grad of param " + std::to_string(param) + " has " +
                          std::to_string(grad.numel()) + " elements, the param " + std::to_string(numel));
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    const Piece& piece = ps[i];
    BucketState& b = buckets_[size_t(piece.bucket)];
    const Tensor target = pool_.slot(take_staging(piece.bucket)).slice(piece.staging_offset, piece.numel);
    const Tensor source = grad.slice(piece.param_offset, piece.numel);
    if (grid) {
      backend_.accumulate_on_grid(backend_.compute_stream(), target, source, grid->exponent, grid->largest);
    } else if (source.data() != target.data()) {
      backend_.accumulate(backend_.compute_stream(), target, source);
    } else {  // autograd accumulated in place
      backend_.declare_access(backend_.compute_stream(), Access::write(target), "autograd accumulates a grad");
    }
    if (!issued(b.phase) && !reported_[size_t(group)][size_t(param)][i]) {
      reported_[size_t(group)][size_t(param)][i] = true;
      --b.waiting;
    }
  }
  if (!on_request_) issue_ready();
  std::vector<GradView> views;
  if (hands_out_views_) {
    // The buckets this grad opened early (their other params' grads are
    // still to come), and the next to issue, which took the staging of the
    // one that just went out (or soon will).
    for (const Piece& piece : ps) open(piece.bucket, views);
    if (next_ < buckets_.size()) open(int(next_), views);
  }
  return views;
}

void BucketReducer::issue_ready() {
  while (next_ < buckets_.size() && (issued(buckets_[next_].phase) || buckets_[next_].waiting == 0)) {
    if (!issued(buckets_[next_].phase)) issue(int(next_));
    ++next_;
  }
}

std::pair<int, int> BucketReducer::bucket_range(int group) const {
  if (group < 0 || group >= int(groups_.size())) {
    throw InvalidArgument("BucketReducer: no group index " + std::to_string(group));
  }
  const int end = group + 1 < int(groups_.size()) ? first_bucket_[size_t(group) + 1] : int(buckets_.size());
  return {first_bucket_[size_t(group)], end};
}

void BucketReducer::reduce_groups(const std::vector<int>& groups) {
  for (int g : groups) {
    const auto [begin, end] = bucket_range(g);
    for (int i = begin; i < end; ++i) {
      if (!issued(buckets_[size_t(i)].phase)) issue(i);
    }
  }
}

void BucketReducer::skip_groups(const std::vector<int>& groups) {
  for (int g : groups) {
    const auto [begin, end] = bucket_range(g);
    for (int i = begin; i < end; ++i) {
      const BucketPhase phase = buckets_[size_t(i)].phase;
      // A grad staged anyway is late: reduced once the ranks agree on it.
      if (!issued(phase)) advance_bucket(i, holds_staging(phase) ? BucketPhase::kLate : BucketPhase::kIssued);
    }
  }
}

void BucketReducer::issue(int index) {
  BucketState& b = buckets_[size_t(index)];
  const LayoutPlan& plan = groups_[size_t(b.group)].plan;
  const Bucket& bucket = plan.buckets()[size_t(b.bucket)];
  const int64_t shard = plan.shard_elems(b.bucket);
  const Tensor staging = pool_.slot(take_staging(index));  // no grads here on this rank: zeros
  const CollectiveKey key{CollectiveKind::kReduceScatter, groups_[size_t(b.group)].tag, b.bucket, bucket.numel};
  backend_.wait(comm_.stream(), *backend_.record(backend_.compute_stream()));  // the grads are in
  in_flight_.push_back(InFlight{index, b.staging,
                                comm_.reduce_scatter(key, staging.slice(0, bucket.numel),
                                                     staging.slice(comm_.rank() * shard, shard))});
  b.staging = -1;  // later grads go to a fresh buffer
  advance_bucket(index, BucketPhase::kIssued);
  // Completed only when its staging is needed (take_staging) or backward
  // ends: the compute stream waits for a reduce-scatter as late as it can,
  // so a unit's reductions run behind the next units' backward (as FSDP2's
  // do) and the staging pool, not a count in flight, bounds the memory.
}

void BucketReducer::complete_oldest() {
  InFlight f = in_flight_.front();
  in_flight_.pop_front();
  Stream& compute = backend_.compute_stream();
  const BucketState& b = buckets_[size_t(f.bucket)];
  const FlatGroupBuffer& group = groups_[size_t(b.group)];
  const int64_t shard = group.plan.shard_elems(b.bucket);
  const Tensor reduced = pool_.slot(f.staging).slice(comm_.rank() * shard, shard);
  const Tensor part = group.buffer.slice(group.plan.partition_offset(b.bucket), shard);
  if (on_host_[size_t(b.group)]) {
    backend_.wait(*down_, *f.event);
    const int slot = landing_.acquire();
    const Tensor landed = landing_.slot(slot).slice(0, shard);
    backend_.copy(*down_, landed, reduced);
    backend_.wait(compute, *backend_.record(*down_));  // the staging was read: it may go back
    backend_.accumulate(*down_, part, landed);          // on the host
    landing_.release(slot, *down_);
  } else {
    backend_.wait(compute, *f.event);
    backend_.accumulate(compute, part, reduced);
  }
  pool_.release(f.staging, compute);
}

void BucketReducer::host_partitions_done() {
  if (down_) backend_.wait(backend_.compute_stream(), *backend_.record(*down_));
}

void BucketReducer::end_backward() {
  for (size_t i = next_; i < buckets_.size(); ++i) buckets_[i].waiting = 0;  // no grad: zeros
  issue_ready();
  while (!in_flight_.empty()) complete_oldest();
  host_partitions_done();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    BucketState& b = buckets_[i];
    b.waiting = b.params;
    // A late bucket keeps its staging: the next backward's reduction takes it along.
    if (issued(b.phase)) {
      advance_bucket(int(i), b.phase == BucketPhase::kLate ? BucketPhase::kStaging : BucketPhase::kEmpty);
    }
    b.viewed = false;
  }
  hands_out_views_ = false;
  for (auto& group : reported_) {
    for (auto& param : group) std::fill(param.begin(), param.end(), false);
  }
  next_ = 0;
}

std::vector<bool> BucketReducer::late() const {
  std::vector<bool> out(buckets_.size());
  for (size_t i = 0; i < buckets_.size(); ++i) out[i] = holds_staging(buckets_[i].phase);
  return out;
}

void BucketReducer::reduce_late(const std::vector<bool>& buckets) {
  if (buckets.size() != buckets_.size()) {
    throw InvalidArgument("BucketReducer.reduce_late: " + std::to_string(buckets.size()) + " flags for " +
                          std::to_string(buckets_.size()) + " buckets");
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets[i]) issue(int(i));
  }
  while (!in_flight_.empty()) complete_oldest();
  host_partitions_done();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].phase == BucketPhase::kIssued) advance_bucket(int(i), BucketPhase::kEmpty);
  }
}

void BucketReducer::drop_late() {
  for (size_t i = 0; i < buckets_.size(); ++i) {
    BucketState& b = buckets_[i];
    if (!holds_staging(b.phase)) continue;
    pool_.release(b.staging, backend_.compute_stream());
    b.staging = -1;
    advance_bucket(int(i), b.phase == BucketPhase::kLate ? BucketPhase::kIssued : BucketPhase::kEmpty);
  }
}

std::vector<Tensor> BucketReducer::partitions() const {
  std::vector<Tensor> parts;
  for (const FlatGroupBuffer& g : groups_) parts.push_back(g.buffer);
  return parts;
}

void BucketReducer::grad_sum_of_squares(Mailbox& box, int sum_slot, int finite_slot) const {
  backend_.sum_of_squares(backend_.compute_stream(), partitions(), box, sum_slot, finite_slot);
}

}  // namespace zerocore
