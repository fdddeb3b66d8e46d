// The multi-rank cases run over a StreamGroup (comm/stream_group.h), for any
// backend: ranks are threads, each with a backend of its own, whose
// collectives are work on its comm stream; the control plane (the rounds,
// the step's exchange) is an InProcessGroup on host memory beside it
// (host_queue), as the engine's gloo control group is beside its data group. Data reaches
// device memory and comes back through each backend's copies, so the same
// cases run on the CPU backends (tests/cpp/test_stream_group.cpp) and on
// one GPU (cuda/tests/test_cuda_ranks.cpp).
//
// Each case compares every rank's result with a reference computed here on
// the host: the collectives bit for bit (sums in rank order in fp32, as the
// group promises), the unit schedule's gathers exactly, the reducer and the
// step against the same step in double.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "zerocore/comm/stream_group.h"
#include "zerocore/half.h"
#include "zerocore/zerocore.h"

namespace zerocore::test {

// How a case makes each rank's backend and its comm streams' flavour.
struct RankDevices {
  std::function<std::unique_ptr<Backend>(int rank)> backend;
  std::function<std::unique_ptr<GroupStream>(Backend&, Stream&)> flavour;
  // After a rank's work: what its backend found wrong ("" when nothing):
  // the checking backend's violations.
  std::function<std::string(Backend&)> verdict = [](Backend&) { return std::string(); };
};

// fn(rank, backend, data queue, control queue) on `world` threads. An
// exception on a rank is a failed check naming it.
inline void on_group_ranks(int world, const RankDevices& devices, std::optional<LateCompletion> late,
                           const std::function<void(int, Backend&, CommQueue&, CommQueue&)>& fn) {
  StreamGroup data(world, late);
  InProcessGroup control(world);
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Backend> backend = devices.backend(r);
        {
          std::unique_ptr<CommQueue> queue = stream_group_queue(data, r, *backend, devices.flavour);
          std::unique_ptr<CommQueue> rounds = host_queue(control, r, *backend);
          fn(r, *backend, *queue, *rounds);
        }
        errors[size_t(r)] = devices.verdict(*backend);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    if (!errors[size_t(r)].empty()) std::fprintf(stderr, "rank %d of %d: %s\n", r, world, errors[size_t(r)].c_str());
    CHECK(errors[size_t(r)].empty());
  }
}

inline float round_to(DType dtype, float x) {
  switch (dtype) {
    case DType::kBFloat16: return bf16_to_float(float_to_bf16(x));
    case DType::kFloat16: return fp16_to_float(float_to_fp16(x));
    case DType::kFloat32: return x;
    case DType::kInt64:
    case DType::kInt40: break;  // the cases sum float elements only (test_stream_group.cpp has int64's)
  }
  return x;
}

// The host's values in a host tensor of `dtype`, and back.
inline Tensor host_tensor(const std::vector<float>& values, DType dtype) {
  Tensor t = Tensor::empty({int64_t(values.size())}, dtype);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) t.data_as<float>()[i] = values[i];
    if (dtype == DType::kBFloat16) t.data_as<uint16_t>()[i] = float_to_bf16(values[i]);
    if (dtype == DType::kFloat16) t.data_as<uint16_t>()[i] = float_to_fp16(values[i]);
  }
  return t;
}

inline std::vector<float> host_values(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype() == DType::kFloat32) out[i] = t.data_as<float>()[i];
    if (t.dtype() == DType::kBFloat16) out[i] = bf16_to_float(t.data_as<uint16_t>()[i]);
    if (t.dtype() == DType::kFloat16) out[i] = fp16_to_float(t.data_as<uint16_t>()[i]);
  }
  return out;
}

// Device memory of `backend` holding `values`, written on the compute stream
// (the host waits, so the host tensor may go).
inline Tensor on_device(Backend& backend, const std::vector<float>& values, DType dtype = DType::kFloat32) {
  const Tensor host = host_tensor(values, dtype);
  Tensor device = Tensor::empty({host.numel()}, dtype, backend, MemoryKind::kDevice, "test data");
  backend.copy(backend.compute_stream(), device, host);
  backend.host_wait(*backend.record(backend.compute_stream()));
  return device;
}

// What `t` holds once the compute stream's work so far is done.
inline std::vector<float> read_back(Backend& backend, const Tensor& t) {
  const Tensor host = Tensor::empty({t.numel()}, t.dtype());
  backend.copy(backend.compute_stream(), host, t);
  backend.host_wait(*backend.record(backend.compute_stream()));
  return host_values(host);
}

inline std::vector<float> random_values(uint64_t seed, int64_t n) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = normal(rng);
  return out;
}

// Every collective against its host reference, bit for bit, at fp32 and
// bf16, three rounds back to back: each round's inputs are written on a
// stream of their own after only a stream wait for the compute stream, which
// waited for the last round's events and copied its results away;
// the host waits once, at the end. A missing wait between the ranks'
// streams (a peer's input read before it is written, or overwritten before
// it is read) shows as a wrong value.
inline void check_collectives(int world, const RankDevices& devices, std::optional<LateCompletion> late) {
  constexpr int kRounds = 3;
  constexpr int64_t kShard = 37;
  const int64_t full = kShard * world;
  auto input = [&](int round, int rank, int what) {
    return random_values(uint64_t(1000 * round + 10 * rank + what), full);
  };
  std::atomic<int> bad{0};
  on_group_ranks(world, devices, late, [&](int r, Backend& backend, CommQueue& q, CommQueue&) {
    Stream& compute = backend.compute_stream();
    Stream& writer = backend.create_stream("writer");
    const std::unique_ptr<GroupStream> late_writer = devices.flavour(backend, writer);  // its delays
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor gather_in = on_device(backend, std::vector<float>(size_t(kShard)), dtype);
      const Tensor gather_out = on_device(backend, std::vector<float>(size_t(full)), dtype);
      const Tensor scatter_in = on_device(backend, std::vector<float>(size_t(full)), dtype);
      const Tensor scatter_out = on_device(backend, std::vector<float>(size_t(kShard)), dtype);
      const Tensor reduce = on_device(backend, std::vector<float>(size_t(full)), dtype);
      const Tensor cast = on_device(backend, std::vector<float>(size_t(full)), dtype);
      const Tensor twice = on_device(backend, std::vector<float>(size_t(kShard)), dtype);
      // Per round: gathered, scattered, scattered in place, broadcast, the gathered scattered.
      std::vector<Tensor> results;
      for (int round = 0; round < kRounds; ++round) {
        // Each collective's input is written on a stream of its own just
        // before the collective, late, and the comm stream waits for it, so
        // a peer's read is ordered after the write only by a mark. (The
        // host enqueues these waits on the comm stream at once, ahead of
        // collectives the queue's thread has yet to issue, so the round's
        // first collective's marks usually cover every write: a missing
        // wait in the sums shows every run, one in the gather or the
        // broadcast now and then.)
        backend.wait(writer, *backend.record(compute));  // free again: compute waited for the last round and read it
        auto written = [&](const Tensor& t, const std::vector<float>& values) {
          // Later the higher the rank: a lower rank's stream, past its own
          // write, reads what a higher rank had there unless it waits.
          late_writer->delay(1000 * (r + 1));
          backend.copy(writer, t, host_tensor(values, dtype));
          backend.wait(q.stream(), *backend.record(writer));
        };
        const std::vector<float> mine = input(round, r, 0);
        std::vector<std::shared_ptr<StreamEvent>> events;
        written(scatter_in, mine);
        events.push_back(q.reduce_scatter({CollectiveKind::kReduceScatter, 2, round, full}, scatter_in, scatter_out));
        // In place: this rank's block of the input is the shard.
        written(reduce, input(round, r, 1));
        events.push_back(q.reduce_scatter({CollectiveKind::kReduceScatter, 3, round, full}, reduce,
                                          reduce.slice(r * kShard, kShard)));
        written(cast, input(round, r, 2));
        events.push_back(q.broadcast({CollectiveKind::kBroadcast, 4, round, full}, cast, world - 1));
        written(gather_in, std::vector<float>(mine.begin(), mine.begin() + kShard));
        events.push_back(q.all_gather({CollectiveKind::kAllGather, 1, round, full}, gather_in, gather_out));
        // The gathered tensor reduced again at once: every rank's input is
        // the output of a collective still in flight on its own stream.
        events.push_back(q.reduce_scatter({CollectiveKind::kReduceScatter, 6, round, full}, gather_out, twice));
        for (const auto& e : events) backend.wait(compute, *e);
        for (const Tensor& t : {gather_out, scatter_out, reduce, cast, twice}) {
          Tensor keep = Tensor::empty({t.numel()}, dtype, backend, MemoryKind::kDevice, "test result");
          backend.copy(compute, keep, t);
          results.push_back(keep);
        }
      }
      // The reduced tensor again, all-reduced (its own key) after the rounds.
      const auto summed = q.all_reduce({CollectiveKind::kAllReduce, 5, 0, full}, scatter_in);
      backend.wait(compute, *summed);
      // The references.
      for (int round = 0; round < kRounds; ++round) {
        std::vector<float> gathered, scattered(size_t(kShard), 0.0f), in_place(size_t(kShard), 0.0f);
        for (int q2 = 0; q2 < world; ++q2) {
          const std::vector<float> v = input(round, q2, 0);
          for (int64_t i = 0; i < kShard; ++i) gathered.push_back(round_to(dtype, v[size_t(i)]));
          const std::vector<float> w = input(round, q2, 1);
          for (int64_t i = 0; i < kShard; ++i) {
            scattered[size_t(i)] += round_to(dtype, v[size_t(r * kShard + i)]);
            in_place[size_t(i)] += round_to(dtype, w[size_t(r * kShard + i)]);
          }
        }
        std::vector<float> cast_want = input(round, world - 1, 2);
        for (float& x : cast_want) x = round_to(dtype, x);
        for (float& x : scattered) x = round_to(dtype, x);
        for (float& x : in_place) x = round_to(dtype, x);
        std::vector<float> twice_want(size_t(kShard), 0.0f);
        for (int q2 = 0; q2 < world; ++q2) {
          for (int64_t i = 0; i < kShard; ++i) twice_want[size_t(i)] += gathered[size_t(r * kShard + i)];
        }
        for (float& x : twice_want) x = round_to(dtype, x);
        const std::vector<float> got_gathered = read_back(backend, results[size_t(5 * round)]);
        const std::vector<float> got_scattered = read_back(backend, results[size_t(5 * round + 1)]);
        const std::vector<float> got_reduced = read_back(backend, results[size_t(5 * round + 2)]);
        const std::vector<float> got_cast = read_back(backend, results[size_t(5 * round + 3)]);
        const std::vector<float> got_twice = read_back(backend, results[size_t(5 * round + 4)]);
        if (got_cast != cast_want) std::fprintf(stderr, "DBG world %d rank %d round %d dtype %d cast stale\n", world, r, round, int(dtype));
        if (got_gathered != gathered || got_scattered != scattered || got_cast != cast_want) ++bad;
        if (got_twice != twice_want) ++bad;
        if (!std::equal(in_place.begin(), in_place.end(), got_reduced.begin() + r * kShard)) ++bad;
      }
      std::vector<float> all(size_t(full), 0.0f);
      for (int q2 = 0; q2 < world; ++q2) {
        const std::vector<float> v = input(kRounds - 1, q2, 0);
        for (int64_t i = 0; i < full; ++i) all[size_t(i)] += round_to(dtype, v[size_t(i)]);
      }
      for (float& x : all) x = round_to(dtype, x);
      if (read_back(backend, scatter_in) != all) ++bad;
    }
  });
  CHECK(bad == 0);
}

// Ranks issuing different collectives: CollectiveMismatch on every rank,
// from the collective's event; the queue fails every later one with it.
inline void check_mismatch(int world, const RankDevices& devices) {
  std::atomic<int> threw{0};
  on_group_ranks(world, devices, std::nullopt, [&](int r, Backend& backend, CommQueue& q, CommQueue&) {
    const Tensor t = on_device(backend, std::vector<float>(8, 1.0f));
    try {
      backend.host_wait(*q.all_reduce({CollectiveKind::kAllReduce, r == 0 ? 1 : 2, 0, 8}, t));
    } catch (const CollectiveMismatch&) {
      ++threw;
    }
    try {
      backend.host_wait(*q.all_reduce({CollectiveKind::kAllReduce, 3, 0, 8}, t));
    } catch (const CollectiveMismatch&) {
      ++threw;
    }
  });
  CHECK(threw == 2 * world);
}

inline LayoutPlan group_plan(int world, const std::vector<int64_t>& numels) {
  std::vector<ParamSpec> specs;
  for (int64_t n : numels) specs.push_back(ParamSpec{n, 0});
  return LayoutPlan::make(specs, LayoutOptions{world, 4, 48});
}

// Stage 3's unit schedule: four units (a root with a buffer of its own,
// three blocks nested in it) gathered from device shards, prefetched and
// released over two steps; every gathered buffer holds its unit's full
// params, read on the compute stream after the hook (as autograd would).
inline void check_unit_schedule(int world, const RankDevices& devices, std::optional<LateCompletion> late) {
  const std::vector<std::vector<int64_t>> numels = {{30, 7}, {20, 33}, {20, 33}, {20, 33}};
  auto value = [](int u, int64_t i) { return float(u * 1000) + 0.5f * float(i); };
  std::atomic<int> bad{0};
  on_group_ranks(world, devices, late, [&](int r, Backend& backend, CommQueue& q, CommQueue& rounds) {
    std::vector<UnitSpec> specs(numels.size());
    specs[0].own_slot = true;
    for (size_t u = 0; u < numels.size(); ++u) {
      const LayoutPlan plan = group_plan(world, numels[u]);
      std::vector<float> shard(static_cast<size_t>(plan.partition_elems()), 0.0f);
      for (int b = 0; b < int(plan.buckets().size()); ++b) {
        for (int64_t i = 0; i < plan.shard_elems(b); ++i) {
          shard[size_t(plan.partition_offset(b) + i)] = value(int(u), plan.shard_offset(b, r) + i);
        }
      }
      specs[u].groups.push_back(FlatGroupBuffer{int32_t(u), plan, on_device(backend, shard)});
    }
    const int64_t block_bytes = 4 * group_plan(world, numels[1]).total_elems();
    UnitSchedule s(q, rounds, specs, DType::kFloat32, block_bytes);
    auto holds = [&](int u, const Tensor& buffer) {
      const std::vector<float> got = read_back(backend, buffer);
      for (int64_t i = 0; i < group_plan(world, numels[size_t(u)]).total_elems(); ++i) {
        if (got[size_t(s.group_offset(u, 0) + i)] != value(u, i)) return false;
      }
      return true;
    };
    for (int step = 0; step < 2; ++step) {
      if (!holds(0, s.pre_forward(0, false).buffer)) ++bad;
      for (int u = 1; u < 4; ++u) {
        if (!holds(u, s.pre_forward(u, true).buffer)) ++bad;
        s.post_forward(u, true);
      }
      s.post_forward(0, true);
      s.end_forward();
      s.begin_backward();
      if (!holds(0, s.pre_backward(0).buffer)) ++bad;
      for (int u = 3; u >= 1; --u) {
        if (!holds(u, s.pre_backward(u).buffer)) ++bad;
        s.post_backward(u);
      }
      s.end_backward();
      s.end_step();
    }
  });
  CHECK(bad == 0);
}

// The bucket reducer and the step (stage 2): each rank's grads, in an order
// of its own, reduced into its grad partition over two backwards, rank 1
// sending one param's grad twice in the first (a late grad, which the
// step's exchange agrees on and reduces); then the step's SGD update on
// each rank's partition and the params' gather. Every rank's params
// against the same step in double.
inline void check_reducer_and_step(int world, const RankDevices& devices, std::optional<LateCompletion> late) {
  constexpr double kLr = 0.1;
  const std::vector<int64_t> numels = {37, 64, 10, 90};
  const LayoutPlan plan = group_plan(world, numels);
  auto grad = [](int r, int p) { return random_values(uint64_t(100 * r + p), 128); };
  auto param = [](int64_t i) { return 0.25f * float(i % 17) - 1.0f; };
  std::vector<double> want(static_cast<size_t>(plan.total_elems()));
  for (size_t i = 0; i < want.size(); ++i) want[i] = param(int64_t(i));  // the padding keeps its values
  for (size_t p = 0; p < numels.size(); ++p) {
    for (int64_t i = 0; i < numels[p]; ++i) {
      double sum = 0.0;
      for (int r = 0; r < world; ++r) sum += 2.0 * grad(r, int(p))[size_t(i)];
      if (p == 1) sum += grad(1, 1)[size_t(i)];
      const int64_t at = plan.params()[p].offset + i;
      want[size_t(at)] = param(at) - kLr * sum / world;
    }
  }
  std::atomic<int> bad{0};
  on_group_ranks(world, devices, late, [&](int r, Backend& backend, CommQueue& data, CommQueue& control) {
    const Tensor grad_part = on_device(backend, std::vector<float>(size_t(plan.partition_elems()), 0.0f));
    std::vector<float> init(static_cast<size_t>(plan.total_elems()));
    for (size_t i = 0; i < init.size(); ++i) init[i] = param(int64_t(i));
    const Tensor full = on_device(backend, init);
    BucketReducer reducer(data, {FlatGroupBuffer{0, plan, grad_part}}, DType::kFloat32, 2);
    std::vector<FlatRun> runs;
    for (size_t b = 0; b < plan.buckets().size(); ++b) {
      const int64_t shard = plan.shard_elems(int(b));
      runs.push_back(FlatRun{0, full.slice(plan.buckets()[b].offset + r * shard, shard),
                             grad_part.slice(plan.partition_offset(int(b)), shard), Tensor(), Tensor(), Tensor()});
    }
    BucketCollectives gather(data, CollectiveKind::kAllGather, {FlatGroupBuffer{0, plan, full}});
    ZeroStep::Parts parts{&data, &control, runs, true, nullptr, &gather};
    parts.grad_reducer = &reducer;
    ZeroStep step(std::move(parts));
    std::vector<int> order(numels.size());
    for (size_t p = 0; p < order.size(); ++p) order[p] = int(p);
    std::shuffle(order.begin(), order.end(), std::mt19937(unsigned(r)));
    for (int backward = 0; backward < 2; ++backward) {
      for (int p : order) {
        const std::vector<float> g = grad(r, p);
        reducer.grad_ready(0, p, on_device(backend, std::vector<float>(g.begin(), g.begin() + numels[size_t(p)])));
      }
      if (backward == 0 && r == 1) {
        const std::vector<float> g = grad(1, 1);
        reducer.grad_ready(0, 1, on_device(backend, std::vector<float>(g.begin(), g.begin() + numels[1])));
      }
      reducer.end_backward();
    }
    StepOptions sgd;
    sgd.kind = OptimizerKind::kSgd;
    sgd.sgd = {SgdOptions{kLr, 0.0, 0.0, 0.0, false}};
    if (!step.step(sgd).applied) ++bad;
    const std::vector<float> got = read_back(backend, full);
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::abs(got[i] - want[i]) > 1e-5 * (1.0 + std::abs(want[i]))) ++bad;
    }
  });
  CHECK(bad == 0);
}

// Every case at world sizes 2 and 4.
inline void check_stream_group(const RankDevices& devices, std::optional<LateCompletion> late) {
  for (int world : {2, 4}) {
    check_collectives(world, devices, late);
    check_mismatch(world, devices);
    check_unit_schedule(world, devices, late);
    check_reducer_and_step(world, devices, late);
  }
}

}  // namespace zerocore::test
