// Ranks as threads: each collective is a rendezvous (rendezvous.h). Every rank publishes its
// key, its tensors and its own argument check; after the first barrier each
// rank checks everyone's (so a bad argument or a mismatched key fails on
// every rank, none waits forever), then moves data; the second barrier keeps
// a rank from reusing its buffers while another still reads them.
#include <cstring>
#include <string>
#include <vector>

#include "zerocore/comm/comm.h"
#include "zerocore/error.h"
#include "zerocore/half.h"
#include "rendezvous.h"

namespace zerocore {

namespace {

float load(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kFloat32: return t.data_as<float>()[i];
    case DType::kBFloat16: return bf16_to_float(t.data_as<uint16_t>()[i]);
    case DType::kFloat16: return fp16_to_float(t.data_as<uint16_t>()[i]);
    case DType::kInt64:
    case DType::kInt40: break;
  }
  throw TypeMismatch("the in-process transport sums float elements only, not int64");
  return 0.0f;
}

void store(const Tensor& t, int64_t i, float x) {
  switch (t.dtype()) {
    case DType::kFloat32: t.data_as<float>()[i] = x; break;
    case DType::kBFloat16: t.data_as<uint16_t>()[i] = float_to_bf16(x); break;
    case DType::kFloat16: t.data_as<uint16_t>()[i] = float_to_fp16(x); break;
    case DType::kInt64:
    case DType::kInt40: throw TypeMismatch("the in-process transport sums float elements only, not int64");
  }
}

void copy_elems(const Tensor& src, int64_t src_offset, const Tensor& dst, int64_t dst_offset, int64_t n) {
  const size_t elem = dtype_size(src.dtype());
  const char* from = static_cast<const char*>(src.data()) + size_t(src_offset) * elem;
  char* to = static_cast<char*>(dst.data()) + size_t(dst_offset) * elem;
  if (from != to) std::memmove(to, from, size_t(n) * elem);
}

}  // namespace

// The rendezvous the transports share.
struct InProcessGroup::State : comm_detail::Rendezvous {
  using Rendezvous::Rendezvous;
};

namespace {

class InProcessTransport : public Transport {
 public:
  InProcessTransport(std::shared_ptr<InProcessGroup::State> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return s_->world(); }

  Completion all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output) override {
    return run(key, shard, output, blocks_error("output", output, shard), [&] {
      const int64_t n = shard.numel();
      for (int q = 0; q < s_->world(); ++q) copy_elems(published(q), 0, output, q * n, n);
    });
  }

  Completion reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard) override {
    return run(key, input, shard, blocks_error("input", input, shard), [&] {
      // Other ranks read only their own blocks of this rank's input, so the
      // sum may land in place.
      const int64_t n = shard.numel(), lo = rank_ * n;
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0.0f;
        for (int q = 0; q < s_->world(); ++q) sum += load(published(q), lo + i);
        store(shard, i, sum);
      }
    });
  }

  Completion all_reduce(const CollectiveKey& key, const Tensor& tensor) override {
    std::vector<float> sum(size_t(tensor.numel()));
    run(key, tensor, tensor, std::string(), [&] {
      for (int q = 0; q < s_->world(); ++q) {
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += load(published(q), int64_t(i));
      }
    });
    // Every rank has read every tensor (run's second barrier): write ours.
    for (size_t i = 0; i < sum.size(); ++i) store(tensor, int64_t(i), sum[i]);
    return {};
  }

  Completion broadcast(const CollectiveKey& key, const Tensor& tensor, int root) override {
    std::string error = root < 0 || root >= s_->world() ? "root " + std::to_string(root) + " is not a rank" : "";
    return run(key, tensor, tensor, std::move(error), [&] {
      if (rank_ != root) copy_elems(published(root), 0, tensor, 0, tensor.numel());
    }, root);
  }

 private:
  // What rank q passed as its input to the collective in progress.
  const Tensor& published(int q) const { return s_->arrival(q).a; }

  // "" when `full` is world_size blocks of `block`'s size; else what is wrong.
  std::string blocks_error(const char* name, const Tensor& full, const Tensor& block) const {
    if (full.numel() == block.numel() * s_->world()) return std::string();
    return std::string(name) + " holds " + std::to_string(full.numel()) + " elements, not world_size x " +
           std::to_string(block.numel());
  }

  // Meets the other ranks (rendezvous.h: every check on every rank), runs
  // `move` before the second barrier: done when it returns.
  template <class Move>
  Completion run(const CollectiveKey& key, const Tensor& a, const Tensor& b, std::string error, Move&& move,
                 int root = 0) {
    if (error.empty() && (a.device().type != DeviceType::kCPU || a.dtype() != b.dtype())) {
      error = "tensors must be host tensors of one dtype";
    }
    s_->meet(rank_, {key, a, b, root, std::move(error)});
    move();
    s_->barrier();
    return {};
  }

  using State = InProcessGroup::State;
  std::shared_ptr<State> s_;
  const int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int world_size, std::optional<LateCompletion> late) : late_(late) {
  if (world_size < 1) throw InvalidArgument("InProcessGroup: world_size must be >= 1");
  state_ = std::make_shared<State>(world_size);
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::world_size() const { return state_->world(); }

std::unique_ptr<Transport> InProcessGroup::transport(int rank) {
  if (rank < 0 || rank >= state_->world()) {
    throw InvalidArgument("InProcessGroup: rank " + std::to_string(rank) + " is not in a group of " +
                          std::to_string(state_->world()));
  }
  std::unique_ptr<Transport> transport = std::make_unique<InProcessTransport>(state_, rank);
  if (!late_) return transport;
  // Each rank's delays drawn apart, so that ranks arrive at a collective at different times.
  return completing_late(std::move(transport), LateCompletion{late_->seed + uint64_t(rank), late_->max_delay_us});
}

}  // namespace zerocore
