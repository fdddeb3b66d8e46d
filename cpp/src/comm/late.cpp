// Late completion, NCCL's way on the host: a call hands its collective to a
// worker and returns before any data moves. The worker runs the inner
// transport's collectives one at a time in issue order (a stream), each after
// a random delay, and waits for each to complete before the next, so the
// contract "wait for the event before touching the buffers" is the only thing
// that makes a caller's reads and reuses right.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "zerocore/comm/comm.h"
#include "zerocore/error.h"
#include "zerocore/runtime/work_queue.h"

namespace zerocore {

namespace {

class LateTransport final : public Transport {
 public:
  LateTransport(std::unique_ptr<Transport> inner, const LateCompletion& late)
      : inner_(std::move(inner)), random_(late.seed), max_delay_us_(std::max(0, late.max_delay_us)) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }

  Completion all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output) override {
    return later([=](Transport& t) { return t.all_gather(key, shard, output); });
  }
  Completion reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard) override {
    return later([=](Transport& t) { return t.reduce_scatter(key, input, shard); });
  }
  Completion all_reduce(const CollectiveKey& key, const Tensor& tensor) override {
    return later([=](Transport& t) { return t.all_reduce(key, tensor); });
  }
  Completion broadcast(const CollectiveKey& key, const Tensor& tensor, int root) override {
    return later([=](Transport& t) { return t.broadcast(key, tensor, root); });
  }

 private:
  // Issued on one thread (the queue's), so the delays follow the seed.
  Completion later(std::function<Completion(Transport&)> collective) {
    const auto delay = std::chrono::microseconds(
        std::uniform_int_distribution<int>(0, max_delay_us_)(random_));
    std::shared_ptr<Event> done = worker_.enqueue([collective = std::move(collective), delay, inner = inner_.get()] {
      std::this_thread::sleep_for(delay);
      const Completion completion = collective(*inner);
      if (completion) completion();
    });
    return [done = std::move(done)] { done->wait(); };
  }

  // The worker goes first: its last jobs still use the inner transport.
  std::unique_ptr<Transport> inner_;
  std::mt19937_64 random_;
  const int max_delay_us_;
  WorkQueue worker_;
};

}  // namespace

std::unique_ptr<Transport> completing_late(std::unique_ptr<Transport> inner, const LateCompletion& late) {
  if (!inner) throw InvalidArgument("completing_late: no transport to wrap");
  return std::make_unique<LateTransport>(std::move(inner), late);
}

std::optional<LateCompletion> late_completion_from_env() {
  const char* value = std::getenv("ZEROCORE_LATE_COMPLETION");
  if (value == nullptr || *value == '\0') return std::nullopt;
  char* end = nullptr;
  const unsigned long long seed = std::strtoull(value, &end, 10);
  if (*end != '\0') {
    throw InvalidArgument(std::string("ZEROCORE_LATE_COMPLETION=") + value +
                          ": set it to a seed (a non-negative integer), or leave it unset");
  }
  return LateCompletion{uint64_t(seed)};
}

}  // namespace zerocore
