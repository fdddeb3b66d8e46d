// StreamGroup (comm/stream_group.h): the rendezvous of the issuing threads,
// then work on each rank's stream ordered by the marks they publish.
//
// Why the published marks are safe to read without a lock of their own: a
// rank writes its ready mark before the rendezvous's first barrier and its
// done mark (and failure) before the second; every rank copies what it needs of them
// after the barrier they were written before and before the next one it
// passes, and no rank writes them again before that next barrier.
#include "zerocore/comm/stream_group.h"

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "rendezvous.h"
#include "zerocore/error.h"

namespace zerocore {

struct StreamGroup::State : comm_detail::Rendezvous {
  explicit State(int world)
      : Rendezvous(world), ready(size_t(world)), done(size_t(world)), failed(size_t(world)) {}
  std::vector<std::shared_ptr<GroupStream::Mark>> ready, done;
  std::vector<std::string> failed;  // what each rank's stream work threw ("" when nothing)
};

namespace {

using Marks = std::vector<std::shared_ptr<GroupStream::Mark>>;

class StreamGroupRank final : public StreamGroupTransport {
 public:
  StreamGroupRank(std::shared_ptr<StreamGroup::State> s, int rank, std::optional<LateCompletion> late)
      : s_(std::move(s)), rank_(rank), late_(late), random_(late ? late->seed : 0) {}

  int rank() const override { return rank_; }
  int world_size() const override { return s_->world(); }
  void issue_on(std::unique_ptr<GroupStream> stream) override {
    if (stream_) throw std::logic_error("StreamGroup: the transport's stream is set already");
    stream_ = std::move(stream);
  }

  Completion all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output) override {
    const int64_t n = shard.numel();
    return run(key, shard, output, blocks_error("output", output, shard), 0, [&](const Peers& p) {
      for (int q = 0; q < world_size(); ++q) {
        const Tensor block = output.slice(q * n, n);
        const Tensor& from = q == rank_ ? shard : p.input[size_t(q)];
        if (from.data() == block.data()) continue;  // this rank's block, gathered in place
        if (q != rank_) stream_->wait(*p.ready[size_t(q)]);
        stream_->copy(block, from);
      }
      return Tensor();
    });
  }

  Completion reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard) override {
    const int64_t n = shard.numel();
    std::string error = blocks_error("input", input, shard);
    if (error.empty()) error = sum_error(input);
    return run(key, input, shard, std::move(error), 0, [&](const Peers& p) { return sum(p, rank_ * n, n); });
  }

  Completion all_reduce(const CollectiveKey& key, const Tensor& tensor) override {
    return run(key, tensor, tensor, sum_error(tensor), 0, [&](const Peers& p) { return sum(p, 0, tensor.numel()); });
  }

  Completion broadcast(const CollectiveKey& key, const Tensor& tensor, int root) override {
    std::string error = root < 0 || root >= world_size() ? "root " + std::to_string(root) + " is not a rank" : "";
    return run(key, tensor, tensor, std::move(error), root, [&](const Peers& p) {
      if (rank_ != root) {
        stream_->wait(*p.ready[size_t(root)]);
        stream_->copy(tensor, p.input[size_t(root)]);
      }
      return Tensor();
    });
  }

 private:
  // What this rank read of the rendezvous: every rank's input and ready mark.
  struct Peers {
    std::vector<Tensor> input;
    Marks ready;
  };

  // "" when `full` is world_size blocks of `block`'s size; else what is wrong.
  std::string blocks_error(const char* name, const Tensor& full, const Tensor& block) const {
    if (full.numel() == block.numel() * world_size()) return std::string();
    return std::string(name) + " holds " + std::to_string(full.numel()) + " elements, not world_size x " +
           std::to_string(block.numel());
  }

  // int40 sums (a grad partition's) never cross ranks: refused, on every rank.
  static std::string sum_error(const Tensor& t) {
    return t.dtype() == DType::kInt40 ? "a stream group sums float and int64 elements, not int40" : "";
  }

  // Elements [lo, lo + n) of every rank's input summed in rank order, in
  // fp32 (int64 for Config(deterministic=True)'s exact sums: integers,
  // exactly), into this rank's scratch (which only this stream touches,
  // so one buffer serves every collective in the stream's order).
  Tensor sum(const Peers& p, int64_t lo, int64_t n) {
    const DType dtype = p.input[0].dtype() == DType::kInt64 ? DType::kInt64 : DType::kFloat32;
    if (!scratch_ || scratch_->bytes() < size_t(n) * dtype_size(dtype)) {
      scratch_ = stream_->backend().allocate(MemoryKind::kDevice, size_t(n) * dtype_size(dtype),
                                             "stream group sums (rank " + std::to_string(rank_) + ")");
    }
    const Tensor total = scratch_->view(0, dtype, {n});
    stream_->zero(total);
    for (int q = 0; q < world_size(); ++q) {
      if (q != rank_) stream_->wait(*p.ready[size_t(q)]);
      stream_->add(total, p.input[size_t(q)].slice(lo, n));
    }
    return total;
  }

  // Meets the peers (every check on every rank), enqueues `reads` (the
  // waits for the peers it reads and the moves; returns a sum still to be
  // written into `out`, or nothing), publishes "done reading", and has the
  // stream wait for every peer's before the sum lands in `out`, which a
  // peer may be reading (all_reduce's tensor is its input).
  template <class Reads>
  Completion run(const CollectiveKey& key, const Tensor& in, const Tensor& out, std::string error, int root,
                 Reads&& reads) {
    if (error.empty() && in.dtype() != out.dtype()) error = "its tensors differ in dtype";
    if (error.empty() && !stream_) error = "the transport has no stream yet (issue_on, when its queue is made)";
    State& s = *s_;
    // A failure of this rank's stream work goes into the rendezvous, so
    // that every rank throws, rather than this one alone while its peers
    // wait for it at a barrier.
    s.ready[size_t(rank_)] = nullptr;
    if (error.empty()) error = failure_of([&] { s.ready[size_t(rank_)] = stream_->mark(); });
    s.meet(rank_, {key, in, out, root, std::move(error)});
    Peers peers;
    for (int q = 0; q < world_size(); ++q) {
      peers.input.push_back(s.arrival(q).a);
      peers.ready.push_back(s.ready[size_t(q)]);
    }
    Tensor total;
    s.failed[size_t(rank_)] = failure_of([&] {
      if (late_) stream_->delay(std::uniform_int_distribution<int>(0, late_->max_delay_us)(random_));
      total = reads(peers);
      s.done[size_t(rank_)] = stream_->mark();
    });
    s.barrier();
    for (int q = 0; q < world_size(); ++q) {
      if (!s.failed[size_t(q)].empty()) {
        throw std::runtime_error("zerocore: " + describe(key) + ": rank " + std::to_string(q) +
                                 "'s stream work failed: " + s.failed[size_t(q)]);
      }
    }
    for (int q = 0; q < world_size(); ++q) {
      if (q != rank_) stream_->wait(*s.done[size_t(q)]);
    }
    if (total.data() != nullptr) {
      if (out.dtype() == total.dtype()) {
        stream_->copy(out, total);
      } else {
        stream_->zero(out);
        stream_->add(out, total);  // rounded once
      }
    }
    return stream_->completion(stream_->mark());
  }

  // What `work` threw ("" when nothing).
  template <class Work>
  static std::string failure_of(Work&& work) {
    try {
      work();
    } catch (const std::exception& e) {
      return e.what();
    }
    return std::string();
  }

  using State = StreamGroup::State;
  const std::shared_ptr<State> s_;
  const int rank_;
  const std::optional<LateCompletion> late_;
  std::mt19937_64 random_;  // the delays, drawn on the issuing thread
  std::unique_ptr<GroupStream> stream_;
  std::shared_ptr<Buffer> scratch_;
};

// A host transport whose collectives start once its queue's stream has
// reached them (host_queue).
class AfterStream final : public Transport {
 public:
  AfterStream(std::unique_ptr<Transport> inner, Backend& backend) : inner_(std::move(inner)), backend_(backend) {}
  void follow(Stream& stream) { stream_ = &stream; }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Completion all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output) override {
    return after([&](Transport& t) { return t.all_gather(key, shard, output); });
  }
  Completion reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard) override {
    return after([&](Transport& t) { return t.reduce_scatter(key, input, shard); });
  }
  Completion all_reduce(const CollectiveKey& key, const Tensor& tensor) override {
    return after([&](Transport& t) { return t.all_reduce(key, tensor); });
  }
  Completion broadcast(const CollectiveKey& key, const Tensor& tensor, int root) override {
    return after([&](Transport& t) { return t.broadcast(key, tensor, root); });
  }

 private:
  template <class Collective>
  Completion after(Collective&& collective) {
    backend_.host_wait(*backend_.record(*stream_));
    return collective(*inner_);
  }

  std::unique_ptr<Transport> inner_;
  Backend& backend_;
  Stream* stream_ = nullptr;  // set as the queue is made, before any collective
};

}  // namespace

StreamGroup::StreamGroup(int world_size, std::optional<LateCompletion> late) : late_(late) {
  if (world_size < 1) throw InvalidArgument("StreamGroup: world_size must be >= 1");
  state_ = std::make_shared<State>(world_size);
}

StreamGroup::~StreamGroup() = default;

int StreamGroup::world_size() const { return state_->world(); }

std::unique_ptr<StreamGroupTransport> StreamGroup::transport(int rank) {
  if (rank < 0 || rank >= state_->world()) {
    throw InvalidArgument("StreamGroup: rank " + std::to_string(rank) + " is not in a group of " +
                          std::to_string(state_->world()));
  }
  // Each rank's delays drawn apart, so that ranks' streams reach a collective at different times.
  std::optional<LateCompletion> late = late_;
  if (late) late->seed += uint64_t(rank);
  return std::make_unique<StreamGroupRank>(state_, rank, late);
}

std::unique_ptr<CommQueue> stream_group_queue(
    StreamGroup& group, int rank, Backend& backend,
    const std::function<std::unique_ptr<GroupStream>(Backend&, Stream&)>& flavour) {
  std::unique_ptr<StreamGroupTransport> transport = group.transport(rank);
  StreamGroupTransport& issuer = *transport;
  auto queue = std::make_unique<CommQueue>(std::move(transport), backend);
  issuer.issue_on(flavour(backend, queue->stream()));
  return queue;
}

std::unique_ptr<CommQueue> host_queue(InProcessGroup& group, int rank, Backend& backend, StreamPlane plane) {
  auto transport = std::make_unique<AfterStream>(group.transport(rank), backend);
  AfterStream& follower = *transport;
  auto queue = std::make_unique<CommQueue>(std::move(transport), backend, plane);
  follower.follow(queue->stream());
  return queue;
}

}  // namespace zerocore
