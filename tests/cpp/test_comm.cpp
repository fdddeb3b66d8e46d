// The in-process transport and the per-group queue: collectives against
// values computed directly, in place as the runtime uses them; a mismatched
// key or a bad argument on one rank fails on every rank, and nothing hangs;
// late completion (as NCCL's) really leaves the buffers alone until the wait.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "thread_ranks.h"
#include "zerocore/zerocore.h"

using namespace zerocore;

namespace {

constexpr int kWorld = 4;

void on_ranks(const std::function<void(int, CommQueue&)>& fn) { test::on_ranks(kWorld, fn); }

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
    q.backend().host_wait(*e4);  // in order: the earlier ones are done too
    if (!(q.backend().query(*e1) && q.backend().query(*e2) && q.backend().query(*e3))) ++bad;
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
      q.backend().host_wait(*e);
    } catch (const CollectiveMismatch& err) {
      ++mismatches;
      const std::string what = err.what();
      if (what.find("rank 3: all_reduce of group 7, bucket 5") != std::string::npos &&
          what.find("rank 0: all_reduce of group 7, bucket 4") != std::string::npos) {
        ++named;
      }
    }
    try {  // the ranks are out of step: later collectives fail, never pair
      q.backend().host_wait(*q.all_reduce(key(CollectiveKind::kAllReduce, 6, 8), t));
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
      q.backend().host_wait(*q.all_gather(key(CollectiveKind::kAllGather, 0, 8), shard, out));
    } catch (const InvalidArgument& err) {
      if (std::string(err.what()).find("rank 1:") != std::string::npos) ++errors;
    } catch (const CollectiveMismatch&) {
      ++errors;  // rank 1's key says 8 elements too; its output is what is wrong
    }
  });
  CHECK(errors == kWorld);
}

// A queue of its own (a group of one rank), for the books alone.
CommQueue solo_queue() { return CommQueue(InProcessGroup(1).transport(0), default_cpu_backend()); }

// Issues an all-reduce of `key` (a tensor of key.numel elements) and waits.
void issue(CommQueue& q, const CollectiveKey& key, bool counted = true) {
  q.backend().host_wait(*q.all_reduce(key, Tensor::empty({key.numel}, DType::kFloat32), counted));
}

void test_fingerprint_equal_on_ranks_that_issued_the_same() {
  std::vector<uint64_t> prints(kWorld);
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q) {
    Tensor t = filled(8, r, DType::kFloat32);
    q.all_reduce(key(CollectiveKind::kAllReduce, 0, 8), t);
    q.broadcast(CollectiveKey{CollectiveKind::kBroadcast, -1, 0, 8}, t, 0);  // control plane: not in the books
    q.backend().host_wait(*q.all_reduce(key(CollectiveKind::kAllReduce, 1, 8), t));
    prints[size_t(r)] = q.fingerprint();
    const std::vector<CollectiveKey> expected{key(CollectiveKind::kAllReduce, 0, 8),
                                              key(CollectiveKind::kAllReduce, 1, 8)};
    if (q.trace() != expected) ++bad;
  });
  CHECK(bad == 0);
  for (uint64_t p : prints) CHECK(p == prints[0]);
}

void test_fingerprint_differs_with_order_and_size() {
  const CollectiveKey a = key(CollectiveKind::kAllReduce, 0, 8), b = key(CollectiveKind::kAllReduce, 1, 8);
  CommQueue ab = solo_queue(), ba = solo_queue(), ab_again = solo_queue(), bigger = solo_queue();
  for (CommQueue* q : {&ab, &ab_again}) {
    issue(*q, a);
    issue(*q, b);
  }
  issue(ba, b);
  issue(ba, a);
  issue(bigger, a);
  issue(bigger, key(CollectiveKind::kAllReduce, 1, 9));
  CHECK(ab.fingerprint() == ab_again.fingerprint());
  CHECK(ab.fingerprint() != ba.fingerprint());
  CHECK(ab.fingerprint() != bigger.fingerprint());
  // Restarting forgets what was issued: the fingerprint of a fresh queue.
  ab.restart_trace();
  CHECK(ab.fingerprint() == solo_queue().fingerprint() && ab.trace().empty());
  issue(ab, b);
  issue(ab, a);
  CHECK(ab.fingerprint() == ba.fingerprint());
}

void test_trace_is_bounded_but_fingerprint_covers_all() {
  CommQueue all = solo_queue(), first_three = solo_queue();
  CHECK(all.trace_limit() == CommQueue::kDefaultTraceLimit);
  all.set_trace_limit(3);
  for (int b = 0; b < 5; ++b) issue(all, key(CollectiveKind::kAllReduce, b, 4));
  for (int b = 0; b < 3; ++b) issue(first_three, key(CollectiveKind::kAllReduce, b, 4));
  CHECK(all.trace().size() == 3 && all.trace() == first_three.trace());
  CHECK(all.fingerprint() != first_three.fingerprint());
  all.set_trace_limit(1);  // a lower limit shortens the trace at once
  CHECK(all.trace().size() == 1);
}

void test_stats_count_counted_data_plane_only() {
  CommQueue q = solo_queue();
  Tensor full = Tensor::empty({8}, DType::kFloat32);
  q.all_gather(key(CollectiveKind::kAllGather, 0, 8), full, full);
  q.all_gather(key(CollectiveKind::kAllGather, 0, 8), full, full, /*counted=*/false);
  q.reduce_scatter(key(CollectiveKind::kReduceScatter, 0, 8), full, full);
  q.all_reduce(key(CollectiveKind::kAllReduce, 0, 8), full);
  q.all_gather(CollectiveKey{CollectiveKind::kAllGather, -1, 0, 8}, full, full);
  q.backend().host_wait(*q.broadcast(CollectiveKey{CollectiveKind::kBroadcast, -1, 0, 8}, full, 0));
  CHECK((q.stats() == std::array<int64_t, 4>{8, 8, 8, 0}));
  CHECK(q.trace().size() == 4);  // the uncounted gather is still in the order contract
  q.reset_stats();
  CHECK((q.stats() == std::array<int64_t, 4>{0, 0, 0, 0}));
  CHECK(q.trace().size() == 4);  // the contract's books are apart from the volume's
}

// A forked child (a rank started by fork) inherits its parent's queue but
// not the queue's thread; dropping the queue there must not wait for it.
void test_forked_child_drops_an_inherited_queue() {
  auto q = std::make_unique<CommQueue>(InProcessGroup(1).transport(0), default_cpu_backend());
  issue(*q, key(CollectiveKind::kAllReduce, 0, 4));
  const pid_t child = fork();
  if (child == 0) {
    alarm(10);  // a hang ends the child with SIGALRM
    q.reset();
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// The late mode bites: a call returns before the collective has read its
// input or written its output. Rank 1 issues its side only after rank 0 has
// read its output early and overwritten its shard, so the collective cannot
// have run yet, whatever the timing: the early read sees the old output and
// the gather takes the overwritten shard, until the completion is waited for.
void test_late_completion_reads_and_writes_late() {
  InProcessGroup group(2, LateCompletion{3, 100});
  std::unique_ptr<Transport> t0 = group.transport(0), t1 = group.transport(1);
  const int64_t n = 4;
  Tensor shard0 = filled(n, 0, DType::kFloat32), shard1 = filled(n, 1, DType::kFloat32);
  Tensor out0 = Tensor::empty({2 * n}, DType::kFloat32), out1 = Tensor::empty({2 * n}, DType::kFloat32);
  std::fill(out0.data_as<float>(), out0.data_as<float>() + 2 * n, -1.0f);
  const CollectiveKey k = key(CollectiveKind::kAllGather, 0, 2 * n);
  Completion done0 = t0->all_gather(k, shard0, out0);
  CHECK(done0);  // not done on return
  bool stale = true;
  for (int64_t i = 0; i < 2 * n; ++i) stale = stale && out0.data_as<float>()[i] == -1.0f;
  CHECK(stale);
  for (int64_t i = 0; i < n; ++i) shard0.data_as<float>()[i] = value(5, i);  // reused before the wait
  std::thread rank1([&] { t1->all_gather(k, shard1, out1)(); });
  done0();
  rank1.join();
  for (int64_t i = 0; i < n; ++i) {
    CHECK(out0.data_as<float>()[i] == value(5, i) && out1.data_as<float>()[i] == value(5, i));
    CHECK(out0.data_as<float>()[n + i] == value(1, i) && out1.data_as<float>()[n + i] == value(1, i));
  }
  // The synchronous group's call is done when it returns.
  InProcessGroup sync(1);
  Tensor solo = filled(n, 0, DType::kFloat32);
  CHECK(!sync.transport(0)->all_reduce(key(CollectiveKind::kAllReduce, 0, n), solo));
}

// One rank; odd buckets complete late, behind a gate (and fail, if told),
// even ones when the call returns.
class GatedTransport : public Transport {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Completion all_reduce(const CollectiveKey& key, const Tensor&) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++issued_;
    }
    cv_.notify_all();
    if (key.bucket % 2 == 0) return {};
    return [this] {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return open_; });
      if (fail_) throw std::runtime_error("the peer went away");
    };
  }
  Completion all_gather(const CollectiveKey&, const Tensor&, const Tensor&) override { return {}; }
  Completion reduce_scatter(const CollectiveKey&, const Tensor&, const Tensor&) override { return {}; }
  Completion broadcast(const CollectiveKey&, const Tensor&, int) override { return {}; }

  void wait_issued(int n) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return issued_ >= n; });
  }
  void open(bool fail) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
      fail_ = fail;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int issued_ = 0;
  bool open_ = false, fail_ = false;
};

bool fails_with(CommQueue& q, const std::shared_ptr<StreamEvent>& e, const char* message) {
  try {
    q.backend().host_wait(*e);
  } catch (const std::runtime_error& error) {
    return std::string(error.what()) == message;
  }
  return false;
}

// Events complete in issue order whether a collective completes on return
// or late; a late failure fails every later collective with it.
void test_events_complete_in_order(bool fail) {
  auto owned = std::make_unique<GatedTransport>();
  GatedTransport& transport = *owned;
  CommQueue q(std::move(owned), default_cpu_backend());
  const Tensor t = filled(4, 0, DType::kFloat32);
  auto late = q.all_reduce(key(CollectiveKind::kAllReduce, 1, 4), t);
  auto on_return = q.all_reduce(key(CollectiveKind::kAllReduce, 2, 4), t);
  transport.wait_issued(2);  // both calls returned, the first not complete
  CHECK(!q.backend().query(*late) && !q.backend().query(*on_return));
  transport.open(fail);
  auto after = q.all_reduce(key(CollectiveKind::kAllReduce, 4, 4), t);
  if (!fail) {
    q.backend().host_wait(*on_return);
    q.backend().host_wait(*after);
    CHECK(q.backend().query(*late));
    return;
  }
  CHECK(fails_with(q, late, "the peer went away") && fails_with(q, on_return, "the peer went away") &&
        fails_with(q, after, "the peer went away"));
}

}  // namespace

// The comm queue on the checking backend, ranks as threads (each its own
// backend, as each process its own): a gather whose shard compute wrote and
// whose output compute then reads is clean with both waits (and gathers the
// right data, late completion or not); without the comm stream's wait for
// compute, or without the host's wait for the gather, the checker names the
// buffer and both accesses.
enum class Missing { kNone, kCommWaitsForCompute, kHostWaitsForGather };

// A rank of these tests: its own checking backend, a queue on it, its
// shard (compute fills it with rank + 1) and the unit it gathers into.
struct CheckedRank {
  static constexpr int64_t kShard = 7, kFull = kShard * kWorld;
  CheckingCpuBackend backend;
  CommQueue q;
  Stream& compute;
  const Tensor mine, whole;
  CheckedRank(InProcessGroup& group, int r, const CheckingOptions& options)
      : backend(options),
        q(group.transport(r), backend),
        compute(backend.compute_stream()),
        mine(backend.allocate(MemoryKind::kDevice, kShard * 4, "shard")->view(0, DType::kFloat32, {kShard})),
        whole(backend.allocate(MemoryKind::kDevice, kFull * 4, "unit")->view(0, DType::kFloat32, {kFull})) {
    backend.fill(compute, mine, float(r + 1));
  }
  std::shared_ptr<StreamEvent> gather() {
    return q.all_gather(CollectiveKey{CollectiveKind::kAllGather, 0, 0, kFull}, mine, whole);
  }
  // Elements of the unit that are not their rank's shard.
  int wrongly_gathered() const {
    int wrong = 0;
    for (int64_t i = 0; i < kFull; ++i) wrong += whole.data_as<float>()[i] != float(i / kShard + 1);
    return wrong;
  }
};

void test_queue_on_the_checking_backend(Missing missing) {
  std::atomic<int> bad{0}, named{0};
  InProcessGroup group(kWorld, late_completion_from_env());
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      CheckedRank rank(group, r, CheckingOptions{uint64_t(20 + r), 0, 300, false});
      CheckingCpuBackend& backend = rank.backend;
      if (missing != Missing::kCommWaitsForCompute) backend.wait(rank.q.stream(), *backend.record(rank.compute));
      auto gathered = rank.gather();
      if (missing != Missing::kHostWaitsForGather) backend.host_wait(*gathered);
      backend.declare_access(rank.compute, Access::read(rank.whole), "forward reads the unit");
      backend.host_wait(*gathered);
      const std::vector<std::string> found = backend.violations();
      if (missing == Missing::kNone) {
        bad += rank.wrongly_gathered();
        if (!found.empty()) ++bad;
        return;
      }
      const std::string expect = missing == Missing::kCommWaitsForCompute
                                     ? "buffer 'shard' (device): 'fill' on stream 'compute' writes"
                                     : "buffer 'unit' (device): 'all_gather of group 0, bucket 0";
      const std::string then = missing == Missing::kCommWaitsForCompute
                                   ? "then 'all_gather of group 0, bucket 0 (28 elements)' on stream 'comm (rank "
                                   : "then 'forward reads the unit' on stream 'compute' reads";
      if (found.size() == 1 && found[0].find(expect) != std::string::npos &&
          found[0].find(then) != std::string::npos) {
        ++named;
      } else {
        for (const auto& f : found) std::fprintf(stderr, "rank %d: %s\n", r, f.c_str());
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(bad == 0);
  CHECK(named == (missing == Missing::kNone ? 0 : kWorld));
}

// The same, throwing at the violation (as the Python suite's checking
// pass does), with rank 1 alone missing the comm stream's wait for compute:
// its gather raises StreamOrderError naming the shard and the gather, and
// is issued all the same, so the other ranks' gathers complete with every
// rank's shard, rank 1's own output is gathered too (a later collective's
// event comes after it), and the ranks stay in step: a later all-reduce
// sums every rank's value, and the fingerprints agree.
void test_unordered_collective_is_issued_and_raises() {
  std::atomic<int> bad{0}, named{0};
  std::vector<uint64_t> fingerprints(kWorld);
  InProcessGroup group(kWorld, late_completion_from_env());
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        CheckedRank rank(group, r, CheckingOptions{uint64_t(30 + r), 0, 300, true});
        CheckingCpuBackend& backend = rank.backend;
        if (r != 1) backend.wait(rank.q.stream(), *backend.record(rank.compute));
        try {
          backend.host_wait(*rank.gather());
          if (r == 1) ++bad;  // no error
        } catch (const StreamOrderError& e) {
          const std::string what = e.what();
          if (r == 1 && what.find("buffer 'shard' (device): 'fill' on stream 'compute' writes") != std::string::npos &&
              what.find("then 'all_gather of group 0, bucket 0 (28 elements)' on stream 'comm (rank 1)' reads") !=
                  std::string::npos) {
            ++named;
          } else {
            std::fprintf(stderr, "rank %d: %s\n", r, e.what());
            ++bad;
          }
        }
        const Tensor sum = backend.allocate(MemoryKind::kDevice, 4, "sum")->view(0, DType::kFloat32, {1});
        backend.fill(rank.compute, sum, float(r + 1));
        backend.wait(rank.q.stream(), *backend.record(rank.compute));
        backend.host_wait(*rank.q.all_reduce(CollectiveKey{CollectiveKind::kAllReduce, 0, 1, 1}, sum));
        if (sum.data_as<float>()[0] != float(kWorld * (kWorld + 1) / 2)) ++bad;
        bad += rank.wrongly_gathered();
        fingerprints[size_t(r)] = rank.q.fingerprint();
      } catch (const std::exception& e) {  // out of step: a collective mismatched
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        ++bad;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(bad == 0);
  CHECK(named == 1);
  CHECK(std::all_of(fingerprints.begin(), fingerprints.end(), [&](uint64_t f) { return f == fingerprints[0]; }));
}

// A collective comes after what its comm stream was made to wait for,
// though a CPU transport moves the data on the queue's issuing thread: the
// input is written late by a job on another stream (Backend::host_tail).
void test_collective_after_what_its_stream_waits_for() {
  std::atomic<int> bad{0};
  test::on_ranks(2, [&](int r, CommQueue& q) {
    Backend& backend = q.backend();
    Stream& writer = backend.create_stream("late writer");
    const Tensor t = Tensor::empty({4}, DType::kFloat32);
    std::fill(t.data_as<float>(), t.data_as<float>() + 4, 0.0f);
    backend.enqueue(writer, "late write", {Access::write(t)}, [t, r] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::fill(t.data_as<float>(), t.data_as<float>() + 4, float(r + 1));
    });
    backend.wait(q.stream(), *backend.record(writer));
    backend.host_wait(*q.all_reduce(key(CollectiveKind::kAllReduce, 0, 4), t));
    for (int i = 0; i < 4; ++i) {
      if (t.data_as<float>()[i] != 3.0f) ++bad;
    }
  });
  CHECK(bad == 0);
}

int main() {
  test_collectives(DType::kFloat32);
  test_collectives(DType::kBFloat16);
  test_mismatch_fails_everywhere();
  test_bad_argument_fails_everywhere();
  test_fingerprint_equal_on_ranks_that_issued_the_same();
  test_fingerprint_differs_with_order_and_size();
  test_trace_is_bounded_but_fingerprint_covers_all();
  test_stats_count_counted_data_plane_only();
  test_forked_child_drops_an_inherited_queue();
  test_late_completion_reads_and_writes_late();
  test_events_complete_in_order(false);
  test_events_complete_in_order(true);
  test_queue_on_the_checking_backend(Missing::kNone);
  test_queue_on_the_checking_backend(Missing::kCommWaitsForCompute);
  test_queue_on_the_checking_backend(Missing::kHostWaitsForGather);
  test_unordered_collective_is_issued_and_raises();
  test_collective_after_what_its_stream_waits_for();
  CHECK(describe(CollectiveKey{CollectiveKind::kReduceScatter, 2, 1, 1234567}) ==
        "reduce_scatter of group 2, bucket 1 (1,234,567 elements)");
  CHECK(describe(CollectiveKey{CollectiveKind::kAllGather, -1, 0, 16}) == "control-plane all_gather (16 elements)");
  return test::finish("test_comm");
}
