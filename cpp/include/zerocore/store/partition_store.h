// The partition store of one flat group: every buffer a rank keeps for the
// params of one LayoutPlan, sized and placed from the plan and the stage's
// placement, and every view into them. Callers (the Python engine, a C++
// embedder) ask for a view by (param, kind), (bucket, kind) or (run, kind)
// and never compute an offset themselves.
//
// A buffer is either whole (the plan's total_elems: the flat buffer, laid
// out param after param) or a partition (partition_elems: this rank's block
// of every bucket, end to end). What is kept, per stage:
//
//   kind          elems      dtype         kept when
//   full          whole      dtype         params not sharded (stages 0-2)
//   shard         partition  dtype         params sharded (stage 3)
//   master        partition  fp32          trainable, dtype != fp32 or optimizer on the host
//   state.<name>  partition  fp32          trainable, one per optimizer state
//   grad_part     partition  reduce dtype  trainable, grads partitioned (stages 2-3)
//   grad_full     whole      reduce dtype  trainable, grads not partitioned (stages 0-1)
//   host_grad     partition  reduce dtype  optimizer on the host and (stage 1 or a delayed update)
//   host_param    partition  dtype         optimizer on the host and dtype != fp32
//
// With exact_sums (Config(deterministic=True) at stages 2-3, grads on the
// device) grad_part's memory is 5 bytes an element: buffer("grad_sums") is
// all of it as int40 (DType::kInt40), the exact sums reduction adds into,
// and the grads (their mean, formed at the step) are its first bytes.
//
// An offloaded group that keeps no host_grad of its own reads its grads
// where reduction leaves them: "host_grad" names grad_part there.
//
// Views are also handed out into buffers the store does not own (a gather
// pool slot, a temporary): anything of whole or partition size.
//
// The buffers are a backend's (backend/backend.h): device memory for what
// lives where training runs, pinned host memory for what an offloaded
// optimizer keeps on the host (the copies between the two are async), so
// the checking backend knows each one by name and checks every access the
// runtime makes to it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "zerocore/backend/backend.h"
#include "zerocore/dtype.h"
#include "zerocore/flat_group_buffer.h"
#include "zerocore/kernels/flat_run.h"
#include "zerocore/layout.h"
#include "zerocore/tensor.h"

namespace zerocore {

// Where a group's training runs (device) or the host, which is where an
// offloaded optimizer keeps its buffers. On a CPU-only run both are host memory.
enum class Where { kDevice, kHost };
// The memory report's categories.
enum class Category { kParam, kGrad, kOptim };

struct StorePlacement {
  int rank = 0;  // this rank's index among the plan's world_size partitions
  DType dtype = DType::kFloat32;         // params
  DType reduce_dtype = DType::kFloat32;  // grads
  bool trainable = true;
  bool sharded = false;           // params kept as a shard (stage 3)
  bool partitions_grads = false;  // stages 2-3
  bool params_on_host = false;    // offloaded params (stage 3)
  bool optimizer_on_host = false;
  bool delayed = false;  // offloaded update overlapping the next backward
  bool exact_sums = false;  // grad_part holds the int40 sums too (the table above)
  std::vector<std::string> state_names;  // optimizer states, in order
};

struct BufferSpec {
  std::string kind;
  Category category;
  Where where;
  bool whole;  // total_elems elements; else partition_elems
  int64_t elems;
  DType dtype;
  bool holds_sums = false;  // grad_part with exact_sums: 5 bytes an element (int40)
  size_t bytes() const { return size_t(elems) * (holds_sums ? dtype_size(DType::kInt40) : dtype_size(dtype)); }
};

// A stretch of this rank's partition inside one bucket whose params all
// belong to one optimizer group: the unit of an optimizer call. It spans
// the alignment gaps between its params.
struct PartitionRun {
  int bucket = 0;
  int param_group = 0;
  int64_t partition_offset = 0;
  int64_t flat_offset = 0;
  int64_t numel = 0;
};

// Elements [offset, offset + numel) of a buffer.
struct Span {
  int64_t offset = 0;
  int64_t numel = 0;
};

// Elements param_offset.. of a param, at `span` of a buffer.
struct Stretch {
  int64_t param_offset = 0;
  Span span;
};

class PartitionStore {
 public:
  // Throws InvalidArgument when rank is outside the plan's world size.
  // The buffers come from `backend` (which must outlive them), named
  // "<kind> of <name>" in the checker's reports.
  PartitionStore(LayoutPlan plan, StorePlacement placement, Backend& backend, std::string name = "a flat group");

  const LayoutPlan& plan() const { return plan_; }
  const StorePlacement& placement() const { return placement_; }
  // The buffers this rank keeps, known before anything is allocated.
  const std::vector<BufferSpec>& buffers() const { return buffers_; }
  size_t planned_bytes(Where where) const;
  // This rank's pieces of params (LayoutPlan::segments) and their runs
  // (empty for a frozen group, which has no optimizer).
  const std::vector<Segment>& segments() const { return segments_; }
  const std::vector<PartitionRun>& runs() const { return runs_; }
  // Indices into segments() of param's pieces, in partition order.
  const std::vector<int>& segments_of(int param) const;

  // Allocates every planned buffer, zeroed (padding and grads must read
  // as zeros; everything else is filled from the params before it is
  // read), each a buffer of its own. Once.
  void allocate();
  // The memory kind of a buffer kept `where`.
  static MemoryKind memory_kind(Where where);
  bool allocated() const { return !tensors_.empty(); }
  bool has(const std::string& kind) const;
  // The buffer of `kind`; throws InvalidArgument naming the planned kinds
  // when it is not kept, or before allocate().
  Tensor buffer(const std::string& kind) const;
  // Offloaded with a host_grad of its own: reduction fills grad_part while
  // the update reads host_grad; at each step they trade places.
  bool swaps_grads() const;
  void swap_grads();
  // zero_grad: zeroes the grads reduction adds into (grad_full, grad_part).
  // Device memory on the backend's compute stream, after what it did with
  // them; host memory (an offloaded grad partition) by the host, at once.
  void zero_grads();

  // The buffer of `kind` with the plan and `tag`, the flat group's key in
  // the collectives (the same on every rank): what the unit schedule, the
  // bucket reducer and the step's bucket collectives take.
  FlatGroupBuffer group_buffer(int32_t tag, const std::string& kind) const { return {tag, plan_, buffer(kind)}; }
  // Per run, the views the optimizer step updates (ZeroStep::Parts::runs;
  // offload's host update, bucket by bucket): the fp32 params (the master
  // where there is one, else the params training reads), the grads (the
  // host's when offloaded, else those reduction leaves), the first two
  // optimizer states, and where the new params go in 16 bits (the params
  // training reads behind a master; offloaded, the host_param copied up).
  // Empty for a frozen group.
  std::vector<FlatRun> flat_runs() const;

  // Where things lie in a buffer of `buffer_elems` elements: a whole or a
  // partition-sized buffer of this plan (throws InvalidArgument for any
  // other size). Views below are these spans of a buffer; a caller with its
  // own tensor type (torch) slices its tensors with them.
  // The whole param; whole buffers only (or world size 1).
  Span param_span(int64_t buffer_elems, int param) const;
  // Where param lives: the whole param in a whole buffer, this rank's
  // pieces of it in a partition.
  std::vector<Stretch> param_spans(int64_t buffer_elems, int param) const;
  // Whole: the bucket. Partition: this rank's block of it.
  Span bucket_span(int64_t buffer_elems, int bucket) const;
  // Rank's block of the bucket in a whole buffer.
  Span shard_span(int64_t buffer_elems, int bucket, int rank) const;
  Span run_span(int64_t buffer_elems, int run) const;
  Span segment_span(int64_t buffer_elems, int segment) const;

  // Views into `buf`, a whole or partition-sized buffer of this plan: what
  // an embedder's forward and backward read and write (cpp/examples).
  Tensor param_view(const Tensor& buf, int param) const { return at(buf, param_span(buf.numel(), param)); }
  // (first element of the param, view) of each piece of param in buf.
  std::vector<std::pair<int64_t, Tensor>> param_stretches(const Tensor& buf, int param) const;

  // The same into this store's buffer of `kind`.
  Tensor param_view(const std::string& kind, int param) const { return param_view(buffer(kind), param); }
  std::vector<std::pair<int64_t, Tensor>> param_stretches(const std::string& kind, int param) const {
    return param_stretches(buffer(kind), param);
  }
  // Run `run` of this store's buffer of `kind` (flat_runs' views).
  Tensor run_view(const std::string& kind, int run) const {
    const Tensor buf = buffer(kind);
    return at(buf, run_span(buf.numel(), run));
  }

 private:
  bool is_whole(int64_t buffer_elems) const;  // else partition-sized; throws for neither
  static Tensor at(const Tensor& buf, Span s) { return buf.slice(s.offset, s.numel); }
  const BufferSpec* spec(const std::string& kind) const;

  LayoutPlan plan_;
  StorePlacement placement_;
  Backend* backend_;
  std::string name_;
  std::vector<BufferSpec> buffers_;
  std::vector<Segment> segments_;
  std::vector<std::vector<int>> segments_of_;
  std::vector<PartitionRun> runs_;
  std::vector<Tensor> tensors_;  // per buffers_ entry, once allocated
  Tensor sums_;  // exact_sums: grad_part's memory as int40
};

}  // namespace zerocore
