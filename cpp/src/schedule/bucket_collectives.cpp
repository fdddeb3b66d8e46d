#include "zerocore/schedule/bucket_collectives.h"

#include <memory>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

BucketCollectives::BucketCollectives(CommQueue& comm, CollectiveKind kind, std::vector<FlatGroupBuffer> buffers)
    : comm_(comm), kind_(kind), buffers_(std::move(buffers)) {
  if (kind == CollectiveKind::kBroadcast) throw InvalidArgument("BucketCollectives: broadcast is no bucket collective");
  for (const FlatGroupBuffer& b : buffers_) {
    // An all-reduce moves whole buckets; the others move each rank's block of them.
    const bool blocks = kind != CollectiveKind::kAllReduce;
    if (b.buffer.numel() != b.plan.total_elems() || (blocks && b.plan.world_size() != comm.world_size())) {
      throw InvalidArgument("BucketCollectives: flat group " + std::to_string(b.tag) + " needs " +
                            std::to_string(b.plan.total_elems()) + " elements" +
                            (blocks ? " planned for " + std::to_string(comm.world_size()) + " ranks" : ""));
    }
  }
}

void BucketCollectives::run() {
  // What the compute stream (the host) did to the buffers is done before
  // the comm stream reads or writes them: the grads accumulated, the params
  // written by the update or copied up by offload's copy stream (which the
  // compute stream waited for).
  Backend& backend = comm_.backend();
  backend.wait(comm_.stream(), *backend.record(backend.compute_stream()));
  // The queue completes in issue order: the last event covers them all
  // (its error is the first failure's). What reads the result (the update,
  // the next forward) runs on the compute stream, so the compute stream
  // waits for it: on CUDA the host goes on; on the CPU the caller is the
  // compute stream and waits where it stands.
  std::shared_ptr<StreamEvent> last;
  for (const FlatGroupBuffer& b : buffers_) {
    for (int i = 0; i < int(b.plan.buckets().size()); ++i) {
      const Bucket& bucket = b.plan.buckets()[size_t(i)];
      const Tensor whole = b.buffer.slice(bucket.offset, bucket.numel);
      const CollectiveKey key{kind_, b.tag, i, bucket.numel};
      if (kind_ == CollectiveKind::kAllReduce) {
        last = comm_.all_reduce(key, whole);
        continue;
      }
      const Tensor mine = b.buffer.slice(b.plan.shard_offset(i, comm_.rank()), b.plan.shard_elems(i));
      last = kind_ == CollectiveKind::kReduceScatter ? comm_.reduce_scatter(key, whole, mine)
                                                     : comm_.all_gather(key, mine, whole);
    }
  }
  if (last) backend.wait(backend.compute_stream(), *last);
}

}  // namespace zerocore
