#include "zerocore/store/partition_store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "zerocore/error.h"

namespace zerocore {

namespace {

// The table in partition_store.h, for one placement.
std::vector<BufferSpec> plan_buffers(const LayoutPlan& plan, const StorePlacement& p) {
  const int64_t whole = plan.total_elems(), part = plan.partition_elems();
  const Where optim_at = p.optimizer_on_host ? Where::kHost : Where::kDevice;
  std::vector<BufferSpec> out;
  if (p.sharded) {
    out.push_back({"shard", Category::kParam, p.params_on_host ? Where::kHost : Where::kDevice, false, part, p.dtype});
  } else {
    out.push_back({"full", Category::kParam, Where::kDevice, true, whole, p.dtype});
  }
  if (!p.trainable) return out;
  if (p.dtype != DType::kFloat32 || p.optimizer_on_host) {
    out.push_back({"master", Category::kOptim, optim_at, false, part, DType::kFloat32});
  }
  for (const std::string& name : p.state_names) {
    out.push_back({"state." + name, Category::kOptim, optim_at, false, part, DType::kFloat32});
  }
  if (p.partitions_grads) {
    out.push_back({"grad_part", Category::kGrad, optim_at, false, part, p.reduce_dtype, p.exact_sums});
  } else {
    out.push_back({"grad_full", Category::kGrad, Where::kDevice, true, whole, p.reduce_dtype});
  }
  if (p.optimizer_on_host) {
    // Stage 1 reduces full grads on the device; a delayed update reads its
    // grads while the next backward accumulates new ones (stages 2-3: into
    // the other of two host buffers, swap_grads).
    if (!p.partitions_grads || p.delayed) {
      out.push_back({"host_grad", Category::kGrad, Where::kHost, false, part, p.reduce_dtype});
    }
    if (p.dtype != DType::kFloat32) {
      out.push_back({"host_param", Category::kParam, Where::kHost, false, part, p.dtype});
    }
  }
  return out;
}

// Consecutive segments of one bucket and optimizer group, merged.
std::vector<PartitionRun> merge_runs(const std::vector<Segment>& segments) {
  std::vector<PartitionRun> out;
  for (const Segment& s : segments) {
    if (!out.empty() && out.back().bucket == s.bucket && out.back().param_group == s.param_group) {
      out.back().numel = s.partition_offset + s.numel - out.back().partition_offset;
    } else {
      out.push_back(PartitionRun{s.bucket, s.param_group, s.partition_offset, s.flat_offset, s.numel});
    }
  }
  return out;
}

}  // namespace

PartitionStore::PartitionStore(LayoutPlan plan, StorePlacement placement, Backend& backend, std::string name)
    : plan_(std::move(plan)), placement_(std::move(placement)), backend_(&backend), name_(std::move(name)) {
  if (placement_.exact_sums && (!placement_.partitions_grads || placement_.optimizer_on_host)) {
    throw InvalidArgument("store: exact_sums needs grads partitioned (stages 2-3) and kept on the device");
  }
  buffers_ = plan_buffers(plan_, placement_);
  segments_ = plan_.segments(placement_.rank);  // checks the rank
  segments_of_.resize(plan_.params().size());
  for (size_t i = 0; i < segments_.size(); ++i) segments_of_[segments_[i].param].push_back(int(i));
  if (placement_.trainable) runs_ = merge_runs(segments_);
}

size_t PartitionStore::planned_bytes(Where where) const {
  size_t n = 0;
  for (const BufferSpec& b : buffers_) n += b.where == where ? b.bytes() : 0;
  return n;
}

const std::vector<int>& PartitionStore::segments_of(int param) const {
  if (param < 0 || param >= int(segments_of_.size())) {
    throw InvalidArgument("store: param " + std::to_string(param) + " is outside the plan's " +
                          std::to_string(segments_of_.size()) + " params");
  }
  return segments_of_[param];
}

void PartitionStore::allocate() {
  if (allocated()) throw InvalidArgument("store: allocate() was already called");
  for (const BufferSpec& b : buffers_) {
    const auto memory = backend_->allocate(memory_kind(b.where), b.bytes(), b.kind + " of " + name_, /*zeroed=*/true);
    tensors_.push_back(memory->view(0, b.dtype, {b.elems}));
    if (b.holds_sums) sums_ = memory->view(0, DType::kInt40, {b.elems});
  }
}

MemoryKind PartitionStore::memory_kind(Where where) {
  return where == Where::kHost ? MemoryKind::kHostPinned : MemoryKind::kDevice;
}

const BufferSpec* PartitionStore::spec(const std::string& kind) const {
  for (const BufferSpec& b : buffers_) {
    if (b.kind == kind) return &b;
  }
  return nullptr;
}

bool PartitionStore::has(const std::string& kind) const {
  return spec(kind) != nullptr || (kind == "grad_sums" && placement_.exact_sums) || (kind == "host_grad" && placement_.optimizer_on_host && spec("grad_part"));
}

Tensor PartitionStore::buffer(const std::string& kind) const {
  if (kind == "grad_sums" && placement_.exact_sums) {
    if (tensors_.empty()) throw InvalidArgument("store: call allocate() before asking for the 'grad_sums' buffer");
    return sums_;
  }
  const BufferSpec* b = spec(kind);
  if (b == nullptr && kind == "host_grad" && placement_.optimizer_on_host) b = spec("grad_part");
  if (b == nullptr) {
    std::string kept;
    for (const BufferSpec& s : buffers_) kept += (kept.empty() ? "" : ", ") + s.kind;
    throw InvalidArgument("store: this placement keeps no '" + kind + "' buffer (it keeps: " + kept + ")");
  }
  if (tensors_.empty()) throw InvalidArgument("store: call allocate() before asking for the '" + kind + "' buffer");
  return tensors_[b - buffers_.data()];
}

bool PartitionStore::swaps_grads() const { return placement_.partitions_grads && spec("host_grad") != nullptr; }

void PartitionStore::swap_grads() {
  if (!swaps_grads()) throw InvalidArgument("store: swap_grads() needs a delayed offloaded update at stage 2 or 3");
  if (tensors_.empty()) throw InvalidArgument("store: call allocate() before swap_grads()");
  std::swap(tensors_[spec("grad_part") - buffers_.data()], tensors_[spec("host_grad") - buffers_.data()]);
}

void PartitionStore::zero_grads() {
  for (const char* kind : {"grad_full", "grad_part"}) {
    if (spec(kind) == nullptr) continue;
    // Host grads too, in the compute stream's order: it waits for what
    // reads them (the offloaded update; on CUDA a host function fills them).
    backend_->fill(backend_->compute_stream(), buffer(kind), 0.0f);
  }
}

std::vector<FlatRun> PartitionStore::flat_runs() const {
  const std::string live = placement_.sharded ? "shard" : "full";
  std::string param = live, grad = has("grad_full") ? "grad_full" : "grad_part", copy;
  if (placement_.optimizer_on_host) {
    param = "master";
    grad = "host_grad";
    if (has("host_param")) copy = "host_param";
  } else if (has("master")) {
    param = "master";
    copy = live;
  }
  std::vector<std::string> states;
  for (const std::string& name : placement_.state_names) states.push_back("state." + name);
  states.resize(2);  // Adam's two, SGD's momentum, or none
  const auto view = [this](const std::string& kind, int run) { return kind.empty() ? Tensor() : run_view(kind, run); };
  std::vector<FlatRun> out;
  for (int k = 0; k < int(runs_.size()); ++k) {
    out.push_back(FlatRun{runs_[size_t(k)].param_group, view(param, k), view(grad, k), view(states[0], k),
                          view(states[1], k), view(copy, k)});
  }
  return out;
}

bool PartitionStore::is_whole(int64_t buffer_elems) const {
  if (buffer_elems == plan_.total_elems()) return true;
  if (buffer_elems == plan_.partition_elems()) return false;
  throw InvalidArgument("store: a buffer of " + std::to_string(buffer_elems) + " elements is neither the plan's " +
                        std::to_string(plan_.total_elems()) + " (whole) nor its " +
                        std::to_string(plan_.partition_elems()) + " (partition)");
}

Span PartitionStore::param_span(int64_t buffer_elems, int param) const {
  segments_of(param);  // checks the index
  if (!is_whole(buffer_elems) && plan_.world_size() > 1) {
    throw InvalidArgument("store: a partition holds pieces of params; use param_spans");
  }
  const ParamSlot& s = plan_.params()[param];
  return Span{s.offset, s.numel};
}

std::vector<Stretch> PartitionStore::param_spans(int64_t buffer_elems, int param) const {
  if (is_whole(buffer_elems)) return {Stretch{0, param_span(buffer_elems, param)}};
  std::vector<Stretch> out;
  for (int i : segments_of(param)) out.push_back(Stretch{segments_[i].param_offset, segment_span(buffer_elems, i)});
  return out;
}

Span PartitionStore::bucket_span(int64_t buffer_elems, int bucket) const {
  const int64_t shard = plan_.shard_elems(bucket);  // checks the bucket
  if (is_whole(buffer_elems)) return Span{plan_.buckets()[bucket].offset, shard * plan_.world_size()};
  return Span{plan_.partition_offset(bucket), shard};
}

Span PartitionStore::shard_span(int64_t buffer_elems, int bucket, int rank) const {
  if (!is_whole(buffer_elems)) throw InvalidArgument("store: a shard is found in a whole buffer, not a partition");
  return Span{plan_.shard_offset(bucket, rank), plan_.shard_elems(bucket)};
}

Span PartitionStore::run_span(int64_t buffer_elems, int run) const {
  if (run < 0 || run >= int(runs_.size())) {
    throw InvalidArgument("store: run " + std::to_string(run) + " is outside this rank's " +
                          std::to_string(runs_.size()) + " runs");
  }
  const PartitionRun& r = runs_[run];
  return Span{is_whole(buffer_elems) ? r.flat_offset : r.partition_offset, r.numel};
}

Span PartitionStore::segment_span(int64_t buffer_elems, int segment) const {
  if (segment < 0 || segment >= int(segments_.size())) {
    throw InvalidArgument("store: segment " + std::to_string(segment) + " is outside this rank's " +
                          std::to_string(segments_.size()) + " segments");
  }
  const Segment& s = segments_[segment];
  return Span{is_whole(buffer_elems) ? s.flat_offset : s.partition_offset, s.numel};
}

std::vector<std::pair<int64_t, Tensor>> PartitionStore::param_stretches(const Tensor& buf, int param) const {
  std::vector<std::pair<int64_t, Tensor>> out;
  for (const Stretch& s : param_spans(buf.numel(), param)) out.emplace_back(s.param_offset, at(buf, s.span));
  return out;
}

}  // namespace zerocore
