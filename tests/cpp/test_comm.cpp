// The in-process transport and the per-group queue: collectives against
// values computed directly, in place as the runtime uses them; a mismatched
// key or a bad argument on one rank fails on every rank, and nothing hangs.
#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "zerocore/zerocore.h"

using namespace zerocore;

namespace {

constexpr int kWorld = 4;

// Runs fn(rank, queue) on kWorld threads, one queue each.
void on_ranks(const std::function<void(int, CommQueue&)>& fn) {
  InProcessGroup group(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      CommQueue queue(group.transport(r));
      fn(r, queue);
    });
  }
  for (auto& t : threads) t.join();
}

float value(int rank, int64_t i) { return float(rank * 1000 + i) * 0.25f; }

Tensor filled(int64_t n, int rank, DType dtype) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == DType::kFloat32) t.data_as<float>()[i] = value(rank, i);
    else t.data_as<uint16_t>()[i] = float_to_bf16(value(rank, i));
  }
  return t;
}

float at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::kFloat32 ? t.data_as<float>()[i] : bf16_to_float(t.data_as<uint16_t>()[i]);
}

CollectiveKey key(CollectiveKind kind, int bucket, int64_t numel) { return CollectiveKey{kind, 7, bucket, numel}; }

void test_collectives(DType dtype) {
  const int64_t shard = 5, full = shard * kWorld;
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q) {
    // All-gather in place: the shard is this rank's block of the output.
    Tensor gathered = filled(full, r, dtype);
    auto e1 = q.all_gather(key(CollectiveKind::kAllGather, 0, full), gathered.slice(r * shard, shard), gathered);
    // Reduce-scatter in place, all-reduce and broadcast, queued behind it.
    Tensor grads = filled(full, r, dtype), summed = filled(full, r, dtype), root_value = filled(full, r, dtype);
    auto e2 = q.reduce_scatter(key(CollectiveKind::kReduceScatter, 1, full), grads, grads.slice(r * shard, shard));
    auto e3 = q.all_reduce(key(CollectiveKind::kAllReduce, 2, full), summed);
    auto e4 = q.broadcast(key(CollectiveKind::kBroadcast, 3, full), root_value, 2);
    e4->wait();  // in order: the earlier ones are done too
    if (!(e1->ready() && e2->ready() && e3->ready())) ++bad;
    for (int64_t i = 0; i < full; ++i) {
      const int owner = int(i / shard);
      if (at(gathered, i) != at(filled(full, owner, dtype), i % shard + owner * shard)) ++bad;
      // Sums in fp32, in rank order, rounded once to the tensor's dtype.
      float sum = 0.0f;
      for (int k = 0; k < kWorld; ++k) sum += at(filled(full, k, dtype), i);
      const float expected = dtype == DType::kFloat32 ? sum : bf16_to_float(float_to_bf16(sum));
      if (at(summed, i) != expected) ++bad;
      if (owner == r && at(grads, i) != expected) ++bad;
      if (at(root_value, i) != at(filled(full, 2, dtype), i)) ++bad;
    }
  });
  CHECK(bad == 0);
}

void test_mismatch_fails_everywhere() {
  std::atomic<int> mismatches{0}, later_failures{0}, named{0};
  on_ranks([&](int r, CommQueue& q) {
    Tensor t = filled(8, r, DType::kFloat32);
    // Rank 3 reduces another bucket of the same size: data would pair silently.
    auto e = q.all_reduce(key(CollectiveKind::kAllReduce, r == 3 ? 5 : 4, 8), t);
    try {
      e->wait();
    } catch (const CollectiveMismatch& err) {
      ++mismatches;
      const std::string what = err.what();
      if (what.find("rank 3: all_reduce of group 7, bucket 5") != std::string::npos &&
          what.find("rank 0: all_reduce of group 7, bucket 4") != std::string::npos) {
        ++named;
      }
    }
    try {  // the ranks are out of step: later collectives fail, never pair
      q.all_reduce(key(CollectiveKind::kAllReduce, 6, 8), t)->wait();
    } catch (const CollectiveMismatch&) {
      ++later_failures;
    }
  });
  CHECK(mismatches == kWorld && named == kWorld && later_failures == kWorld);
}

void test_bad_argument_fails_everywhere() {
  std::atomic<int> errors{0};
  on_ranks([&](int r, CommQueue& q) {
    Tensor out = Tensor::empty({r == 1 ? 7 : 8}, DType::kFloat32), shard = Tensor::empty({2}, DType::kFloat32);
    try {
      q.all_gather(key(CollectiveKind::kAllGather, 0, 8), shard, out)->wait();
    } catch (const InvalidArgument& err) {
      if (std::string(err.what()).find("rank 1:") != std::string::npos) ++errors;
    } catch (const CollectiveMismatch&) {
      ++errors;  // rank 1's key says 8 elements too; its output is what is wrong
    }
  });
  CHECK(errors == kWorld);
}

}  // namespace

int main() {
  test_collectives(DType::kFloat32);
  test_collectives(DType::kBFloat16);
  test_mismatch_fails_everywhere();
  test_bad_argument_fails_everywhere();
  CHECK(describe(CollectiveKey{CollectiveKind::kReduceScatter, 2, 1, 1234567}) ==
        "reduce_scatter of group 2, bucket 1 (1,234,567 elements)");
  return test::finish("test_comm");
}
