#include "zerocore/layout.h"

#include <algorithm>
#include <string>

#include "fnv1a.h"
#include "zerocore/error.h"

namespace zerocore {

namespace {

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

LayoutPlan LayoutPlan::make(const std::vector<ParamSpec>& specs, const LayoutOptions& options) {
  if (options.world_size < 1) {
    throw InvalidArgument("layout: world_size must be >= 1, got " + std::to_string(options.world_size));
  }
  if (options.align_elems < 1) {
    throw InvalidArgument("layout: align_elems must be >= 1, got " + std::to_string(options.align_elems));
  }
  if (options.bucket_elems < 0) {
    throw InvalidArgument("layout: bucket_elems must be >= 0, got " + std::to_string(options.bucket_elems));
  }
  LayoutPlan plan;
  plan.options_ = options;

  // Place params one after another, each on an alignment boundary.
  int64_t end = 0;
  plan.params_.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].numel < 0) {
      throw InvalidArgument("layout: param " + std::to_string(i) + " has negative size");
    }
    ParamSlot slot;
    slot.offset = round_up(end, options.align_elems);
    slot.numel = specs[i].numel;
    slot.param_group = specs[i].param_group;
    end = slot.offset + slot.numel;
    plan.param_elems_ += slot.numel;
    plan.params_.push_back(slot);
  }
  if (end == 0) return plan;

  // Cut the buffer into constant-size buckets; each splits evenly over the
  // ranks on alignment boundaries, the last one is only as large as needed.
  const int64_t unit = int64_t(options.world_size) * options.align_elems;
  const int64_t bucket = options.bucket_elems == 0 ? round_up(end, unit) : round_up(options.bucket_elems, unit);
  for (int64_t off = 0; off < end; off += bucket) {
    Bucket b;
    b.offset = off;
    b.numel = off + bucket <= end ? bucket : round_up(end - off, unit);
    b.first_param = int(plan.params_.size());
    plan.buckets_.push_back(b);
  }
  plan.total_elems_ = plan.buckets_.back().offset + plan.buckets_.back().numel;

  for (size_t i = 0; i < plan.params_.size(); ++i) {
    ParamSlot& p = plan.params_[i];
    if (p.numel == 0) continue;  // keeps first_bucket=0 > last_bucket=-1
    p.first_bucket = int(p.offset / bucket);
    p.last_bucket = int((p.offset + p.numel - 1) / bucket);
    for (int b = p.first_bucket; b <= p.last_bucket; ++b) {
      plan.buckets_[b].first_param = std::min(plan.buckets_[b].first_param, int(i));
      plan.buckets_[b].last_param = std::max(plan.buckets_[b].last_param, int(i));
    }
  }
  for (Bucket& b : plan.buckets_) {
    if (b.last_param < 0) b.first_param = 0;  // only alignment padding
  }
  return plan;
}

const Bucket& LayoutPlan::bucket_at(int bucket) const {
  if (bucket < 0 || bucket >= int(buckets_.size())) {
    throw InvalidArgument("layout: bucket " + std::to_string(bucket) + " is outside the plan's " +
                          std::to_string(buckets_.size()) + " buckets");
  }
  return buckets_[bucket];
}

int64_t LayoutPlan::shard_elems(int bucket) const { return bucket_at(bucket).numel / options_.world_size; }

int64_t LayoutPlan::partition_offset(int bucket) const { return bucket_at(bucket).offset / options_.world_size; }

int64_t LayoutPlan::shard_offset(int bucket, int rank) const {
  if (rank < 0 || rank >= options_.world_size) {
    throw InvalidArgument("layout: rank " + std::to_string(rank) + " is outside world_size " +
                          std::to_string(options_.world_size));
  }
  return bucket_at(bucket).offset + int64_t(rank) * shard_elems(bucket);
}

std::vector<Segment> LayoutPlan::segments(int rank) const {
  if (rank < 0 || rank >= options_.world_size) {
    throw InvalidArgument("layout: rank " + std::to_string(rank) + " is outside world_size " +
                          std::to_string(options_.world_size));
  }
  std::vector<Segment> out;
  for (int b = 0; b < int(buckets_.size()); ++b) {
    const int64_t lo_shard = shard_offset(b, rank);
    const int64_t hi_shard = lo_shard + shard_elems(b);
    for (int i = buckets_[b].first_param; i <= buckets_[b].last_param; ++i) {
      const ParamSlot& p = params_[i];
      const int64_t lo = std::max(p.offset, lo_shard);
      const int64_t hi = std::min(p.offset + p.numel, hi_shard);
      if (lo >= hi) continue;
      out.push_back(Segment{i, p.param_group, b, lo - p.offset, lo, partition_offset(b) + (lo - lo_shard), hi - lo});
    }
  }
  return out;
}

uint64_t LayoutPlan::fingerprint() const {
  Fnv1a f;
  f.add(options_.world_size);
  f.add(options_.align_elems);
  f.add(options_.bucket_elems);
  f.add(int64_t(params_.size()));
  for (const ParamSlot& p : params_) {
    f.add(p.numel);
    f.add(p.param_group);
  }
  f.add(total_elems_);
  return f.h;
}

}  // namespace zerocore
