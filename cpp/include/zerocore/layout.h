// The layout planner: where every parameter of one dtype lives in a flat
// buffer, how that buffer is cut into constant-size buckets, and which part
// of each bucket every data-parallel rank owns.
//
// Parameters are placed in the order given, which callers make backward
// order (the reverse of first use in forward), so buckets fill in the order
// gradients become ready. Each parameter starts on an `align_elems` boundary.
// The buffer is cut every `bucket_elems` elements regardless of parameter
// boundaries, so a parameter may straddle buckets and ranks: bucket sizes
// stay constant whatever the model (ZeRO-R's constant-size buffers). Every
// bucket is a multiple of world_size * align_elems, so rank r's shard of
// bucket b is the b-th block [offset + r*size/N, offset + (r+1)*size/N) and a
// reduce-scatter or all-gather works in place on the bucket.
//
// A rank's partition is the concatenation of its shards over all buckets,
// total_elems / world_size elements; the optimizer state for that rank is
// one flat array in that order.
#pragma once
#include <cstdint>
#include <vector>

namespace zerocore {

struct ParamSpec {
  int64_t numel = 0;
  int param_group = 0;  // the optimizer's param group
};

struct LayoutOptions {
  int world_size = 1;
  int64_t align_elems = 1;    // start alignment of every param and shard
  int64_t bucket_elems = 0;   // target bucket size; 0: one bucket for all
};

struct ParamSlot {
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
  int param_group = 0;
  int first_bucket = 0;  // buckets the param overlaps, inclusive;
  int last_bucket = -1;  // last < first for an empty param
};

struct Bucket {
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;   // a multiple of world_size * align_elems
  // Params overlapping this bucket: indices [first_param, last_param] in
  // placement order (empty when last_param < first_param).
  int first_param = 0;
  int last_param = -1;
};

// A contiguous piece of one param owned by one rank.
struct Segment {
  int param = 0;
  int param_group = 0;
  int bucket = 0;
  int64_t param_offset = 0;      // first element within the param
  int64_t flat_offset = 0;       // first element in the flat buffer
  int64_t partition_offset = 0;  // first element in the rank's partition
  int64_t numel = 0;
};

class LayoutPlan {
 public:
  // Throws InvalidArgument on a negative size, world_size < 1, align < 1.
  static LayoutPlan make(const std::vector<ParamSpec>& params, const LayoutOptions& options);

  const LayoutOptions& options() const { return options_; }
  int world_size() const { return options_.world_size; }
  int64_t total_elems() const { return total_elems_; }  // padded buffer size
  int64_t partition_elems() const { return total_elems_ / options_.world_size; }
  int64_t padding_elems() const { return total_elems_ - param_elems_; }
  const std::vector<ParamSlot>& params() const { return params_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }

  // Flat-buffer offset of rank's shard of bucket b, and its size. Throw
  // InvalidArgument for a bucket or rank out of range.
  int64_t shard_offset(int bucket, int rank) const;
  int64_t shard_elems(int bucket) const;
  // Offset of bucket b's shard within each rank's partition.
  int64_t partition_offset(int bucket) const;

  // The pieces of params that `rank` owns, in flat-buffer order.
  std::vector<Segment> segments(int rank) const;

  // A hash of everything above; ranks compare it before any collective so a
  // mismatched model fails fast instead of deadlocking.
  uint64_t fingerprint() const;

 private:
  const Bucket& bucket_at(int bucket) const;

  LayoutOptions options_;
  int64_t total_elems_ = 0;
  int64_t param_elems_ = 0;
  std::vector<ParamSlot> params_;
  std::vector<Bucket> buckets_;
};

}  // namespace zerocore
