// The native schedule on ranks that are threads (the CPU backend every test
// runs): stage 3's units gather the right bytes into a fixed pool, prefetch
// along the last step's order and release at structural points; gradient
// buckets reduce to the sum over ranks whatever order (or whether) grads
// arrive on each rank, late grads included.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <map>
#include <random>
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
constexpr int64_t kAlign = 4, kBucketElems = 48;

void on_ranks(const std::function<void(int, CommQueue&)>& fn) { test::on_ranks(kWorld, fn); }
void on_ranks(const std::function<void(int, CommQueue&, CommQueue&)>& fn) {
  test::on_ranks_with_rounds(kWorld, fn);
}

LayoutPlan plan_of(const std::vector<int64_t>& numels) {
  std::vector<ParamSpec> specs;
  for (int64_t n : numels) specs.push_back(ParamSpec{n, 0});
  return LayoutPlan::make(specs, LayoutOptions{kWorld, kAlign, kBucketElems});
}

// The value every rank agrees element i of unit u's flat group g holds.
float full_value(int u, int g, int64_t i) { return float(u * 1000 + g * 100) + 0.5f * float(i); }

FlatGroupBuffer unit_shard(int u, int g, int rank, const std::vector<int64_t>& numels) {
  FlatGroupBuffer out{u * 10 + g, plan_of(numels), Tensor()};
  out.buffer = Tensor::empty({out.plan.partition_elems()}, DType::kFloat32);
  for (int b = 0; b < int(out.plan.buckets().size()); ++b) {
    const int64_t lo = out.plan.shard_offset(b, rank), n = out.plan.shard_elems(b);
    float* shard = out.buffer.data_as<float>() + out.plan.partition_offset(b);
    for (int64_t i = 0; i < n; ++i) shard[i] = full_value(u, g, lo + i);
  }
  return out;
}

bool holds_unit(const UnitSchedule& s, const std::vector<UnitSpec>& specs, int u, const Tensor& buffer) {
  for (size_t g = 0; g < specs[size_t(u)].groups.size(); ++g) {
    const int64_t base = s.group_offset(u, int(g));
    for (int64_t i = 0; i < specs[size_t(u)].groups[g].plan.total_elems(); ++i) {
      if (buffer.data_as<float>()[base + i] != full_value(u, int(g), i)) return false;
    }
  }
  return true;
}

void test_units() {
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q, CommQueue& rq) {
    // A root with a buffer of its own and three blocks (one with a frozen group).
    std::vector<UnitSpec> specs(4);
    specs[0].own_slot = true;
    specs[0].groups.push_back(unit_shard(0, 0, r, {30, 7}));
    for (int u = 1; u < 4; ++u) specs[size_t(u)].groups.push_back(unit_shard(u, 0, r, {20, 33}));
    specs[2].groups.push_back(unit_shard(2, 1, r, {9}));
    const int64_t block_bytes = 4 * (plan_of({20, 33}).total_elems() + plan_of({9}).total_elems());
    UnitSchedule s(q, rq, specs, DType::kFloat32, block_bytes);  // prefetch one unit
    if (s.pool_slots() != 2) ++bad;
    // A prefetch budget larger than the model plans no more slots than units.
    if (UnitSchedule(q, rq, specs, DType::kFloat32, int64_t(1) << 40).pool_slots() != 3) ++bad;
    int64_t blocking_before = 0;
    for (int step = 0; step < 3; ++step) {
      // Forward: root, then blocks 1..3 inside it.
      if (!holds_unit(s, specs, 0, s.pre_forward(0, false).buffer)) ++bad;
      for (int u = 1; u < 4; ++u) {
        if (!holds_unit(s, specs, u, s.pre_forward(u, true).buffer)) ++bad;
        // From the second step on, the next block is on its way.
        if (step > 0 && u < 3 && !s.gathered(u + 1)) ++bad;
        s.post_forward(u, true);
        if (s.gathered(u)) ++bad;  // released after its forward
      }
      s.post_forward(0, true);
      s.end_forward();
      for (int u = 1; u < 4; ++u) bad += s.gathered(u) ? 1 : 0;
      if (!s.gathered(0)) ++bad;  // the root's own buffer stays gathered for its backward
      // Backward: root first, then blocks 3..1, each released at its post-backward point.
      s.begin_backward();
      if (!holds_unit(s, specs, 0, s.pre_backward(0).buffer)) ++bad;
      for (int u = 3; u >= 1; --u) {
        if (!holds_unit(s, specs, u, s.pre_backward(u).buffer)) ++bad;
        if (u > 1 && !s.gathered(u - 1)) ++bad;  // prefetched in reverse forward order
        s.post_backward(u);
        if (s.gathered(u)) ++bad;
      }
      if (!s.gathered(0)) ++bad;  // the root's inputs need no grad: held to the end
      s.end_backward();
      for (int u = 0; u < 4; ++u) bad += s.gathered(u) ? 1 : 0;
      s.end_step();
      // The step's round gathers what the next forward starts with.
      if (!s.gathered(0) || !s.gathered(1)) ++bad;
      if (s.pool_slots() != 2) ++bad;  // nothing allocated after the plan
      // Each hook posts a round that the next one settles; only the end of
      // the backward and the step's round are waited for at once.
      if (step > 0 && s.blocking_rounds() - blocking_before != 2) ++bad;
      blocking_before = s.blocking_rounds();
    }
    // Three blocks in use at once (nested units): the pool grows, contents stay right.
    std::vector<Tensor> held;
    for (int u = 1; u < 4; ++u) held.push_back(s.pre_forward(u, false).buffer);
    for (int u = 1; u < 4; ++u) {
      if (!holds_unit(s, specs, u, held[size_t(u - 1)])) ++bad;
    }
    if (s.pool_slots() != 3) ++bad;
    s.end_forward();
    // A whole-unit copy outside the pool.
    Tensor copy = Tensor::empty({s.unit_elems(2)}, DType::kFloat32);
    s.gather_into(2, copy);
    if (!holds_unit(s, specs, 2, copy)) ++bad;
  });
  CHECK(bad == 0);
}

// Rank r's grad of param p of group g, element i.
float grad_value(int r, int g, int p, int64_t i) { return float((r + 1) * (g + 2)) * 0.25f + float(p) - 0.125f * float(i % 7); }

void test_buckets() {
  const std::vector<std::vector<int64_t>> groups = {{17, 40, 5, 64}, {30, 3}};
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q, CommQueue& control) {
    std::vector<FlatGroupBuffer> spec;
    for (size_t g = 0; g < groups.size(); ++g) {
      FlatGroupBuffer rg{int32_t(g), plan_of(groups[g]), Tensor()};
      rg.buffer = Tensor::empty({rg.plan.partition_elems()}, DType::kFloat32);
      std::fill(rg.buffer.data_as<float>(), rg.buffer.data_as<float>() + rg.buffer.numel(), 0.0f);
      spec.push_back(rg);
    }
    BucketReducer reducer(q, spec, DType::kFloat32, 2);
    // Each rank reports its grads in its own order; rank 1 gives param 2 of
    // group 0 no grad; param 0 of group 1 accumulates in place; rank 2 sends
    // a late second grad for param 1 of group 0 after its bucket went out:
    // the second backward's reduction takes the first one's along, and the
    // step's exchange has every rank reduce that bucket once more.
    std::vector<std::pair<int, int>> order;
    for (int g = 0; g < 2; ++g)
      for (int p = 0; p < int(groups[size_t(g)].size()); ++p) order.emplace_back(g, p);
    std::shuffle(order.begin(), order.end(), std::mt19937(unsigned(r)));
    auto grad_of = [&](int g, int p) {
      Tensor t = Tensor::empty({groups[size_t(g)][size_t(p)]}, DType::kFloat32);
      for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = grad_value(r, g, p, i);
      return t;
    };
    int slots_after_first = 0;
    for (int backward = 0; backward < 2; ++backward) {
      Tensor in_place = reducer.grad_views(1)[0];
      if (in_place.numel() != 30) ++bad;
      for (int64_t i = 0; i < 30; ++i) in_place.data_as<float>()[i] = grad_value(r, 1, 0, i);
      for (auto [g, p] : order) {
        if (r == 1 && g == 0 && p == 2) continue;
        reducer.grad_ready(g, p, g == 1 && p == 0 ? in_place : grad_of(g, p));
      }
      if (r == 2) reducer.grad_ready(0, 1, grad_of(0, 1));
      reducer.end_backward();
      // Staging grows to what this arrival order needs once, then stays.
      if (backward == 0) slots_after_first = reducer.staging_slots();
      if (reducer.staging_slots() != slots_after_first) ++bad;
    }
    ZeroStep step(ZeroStep::Parts{&q, &control, {}, true});
    step.set_grad_reducer(&reducer);
    step.exchange();
    if (reducer.late() != std::vector<bool>(reducer.late().size(), false)) ++bad;
    // Two backwards, summed over ranks, plus rank 2's late grads.
    for (size_t g = 0; g < groups.size(); ++g) {
      const LayoutPlan& plan = spec[g].plan;
      for (const Segment& seg : plan.segments(r)) {
        for (int64_t i = 0; i < seg.numel; ++i) {
          float want = 0.0f;
          for (int k = 0; k < kWorld; ++k) {
            if (!(k == 1 && g == 0 && seg.param == 2)) want += grad_value(k, int(g), seg.param, seg.param_offset + i);
          }
          want *= 2.0f;
          if (g == 0 && seg.param == 1) want += 2.0f * grad_value(2, 0, 1, seg.param_offset + i);
          const float got = spec[g].buffer.data_as<float>()[seg.partition_offset + i];
          if (std::abs(got - want) > 1e-4f * (1.0f + std::abs(want))) ++bad;
        }
      }
    }
  });
  CHECK(bad == 0);
}

// Stage 2's grad views: handed out as buckets take staging (the first bucket
// at begin_backward, the next as the one before goes out, the rest of one an
// early grad opened). Grads written into them are reduced as added ones
// are; no two views handed out and not yet reported overlap (no staging is
// reused under a view); in plan order every param that lies in one bucket
// gets its view before its grad, and the staging stays as planned. Ranks
// 1 and 3 report in shuffled orders, rank 2 gives one param no grad.
void test_grad_views_as_buckets_take_staging() {
  const std::vector<std::vector<int64_t>> groups = {{17, 40, 5, 64, 9, 12}, {30, 3}};
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q) {
    std::vector<FlatGroupBuffer> spec;
    int single = 0;  // params that lie in one bucket
    for (size_t g = 0; g < groups.size(); ++g) {
      FlatGroupBuffer rg{int32_t(g), plan_of(groups[g]), Tensor()};
      rg.buffer = Tensor::empty({rg.plan.partition_elems()}, DType::kFloat32);
      std::fill(rg.buffer.data_as<float>(), rg.buffer.data_as<float>() + rg.buffer.numel(), 0.0f);
      for (const ParamSlot& slot : rg.plan.params()) {
        single += std::count_if(rg.plan.buckets().begin(), rg.plan.buckets().end(), [&](const Bucket& b) {
          return b.offset <= slot.offset && slot.offset + slot.numel <= b.offset + b.numel;
        });
      }
      spec.push_back(rg);
    }
    BucketReducer reducer(q, spec, DType::kFloat32, 3);
    std::vector<std::pair<int, int>> order;
    for (int g = 0; g < 2; ++g)
      for (int p = 0; p < int(groups[size_t(g)].size()); ++p) order.emplace_back(g, p);
    if (r % 2 == 1) std::shuffle(order.begin(), order.end(), std::mt19937(unsigned(r)));
    std::map<std::pair<int, int>, Tensor> live;  // views handed out, their params not yet reported
    auto take = [&](const std::vector<GradView>& views) {
      for (const GradView& v : views) {
        const float* lo = v.view.data_as<float>();
        for (const auto& [key, other] : live) {
          const float* olo = other.data_as<float>();
          if (key == std::make_pair(v.group, v.param) || (lo < olo + other.numel() && olo < lo + v.view.numel())) ++bad;
        }
        if (v.view.numel() != groups[size_t(v.group)][size_t(v.param)]) ++bad;
        live[{v.group, v.param}] = v.view;
      }
    };
    for (int backward = 0; backward < 2; ++backward) {
      int in_place = 0;
      take(reducer.begin_backward());
      for (auto [g, p] : order) {
        if (r == 2 && g == 0 && p == 3) continue;
        auto it = live.find({g, p});
        Tensor grad = it != live.end() ? it->second : Tensor::empty({groups[size_t(g)][size_t(p)]}, DType::kFloat32);
        for (int64_t i = 0; i < grad.numel(); ++i) grad.data_as<float>()[i] = grad_value(r, g, p, i);
        if (it != live.end()) {
          ++in_place;
          live.erase(it);
        }
        take(reducer.grad_ready(g, p, grad));
      }
      live.clear();  // end_backward ends every view
      reducer.end_backward();
      if (r == 0 && (in_place != single || reducer.staging_slots() != 3)) ++bad;
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      for (const Segment& seg : spec[g].plan.segments(r)) {
        for (int64_t i = 0; i < seg.numel; ++i) {
          float want = 0.0f;
          for (int k = 0; k < kWorld; ++k) {
            if (!(k == 2 && g == 0 && seg.param == 3)) want += 2.0f * grad_value(k, int(g), seg.param, seg.param_offset + i);
          }
          const float got = spec[g].buffer.data_as<float>()[seg.partition_offset + i];
          if (std::abs(got - want) > 1e-4f * (1.0f + std::abs(want))) ++bad;
        }
      }
    }
  });
  CHECK(bad == 0);
}

// Stage 3's order: a unit is reduced once the ranks agree it is done, while
// the next unit's grads accumulate; the unit after that takes the staging
// slot of the reduction still in flight (completing it) instead of a third.
void test_in_flight_reduction_gives_its_staging_back() {
  constexpr int kUnits = 4;
  const std::vector<int64_t> numels = {20, 17};  // one bucket a unit
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q) {
    std::vector<FlatGroupBuffer> reduce;
    for (int u = 0; u < kUnits; ++u) {
      reduce.push_back(FlatGroupBuffer{int32_t(u), plan_of(numels), Tensor::empty({plan_of(numels).partition_elems()},
                                                                              DType::kFloat32)});
      std::fill(reduce.back().buffer.data_as<float>(),
                reduce.back().buffer.data_as<float>() + reduce.back().buffer.numel(), 0.0f);
    }
    BucketReducer reducer(q, reduce, DType::kFloat32, 2, /*on_request=*/true);
    for (int u = 0; u < kUnits; ++u) {
      for (int p = 0; p < 2; ++p) {
        Tensor t = Tensor::empty({numels[size_t(p)]}, DType::kFloat32);
        for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = grad_value(r, u, p, i);
        reducer.grad_ready(u, p, t);
      }
      if (u > 0) reducer.reduce_groups({u - 1});  // agreed one unit later
    }
    reducer.end_backward();
    if (reducer.staging_slots() != 2) ++bad;
    for (int u = 0; u < kUnits; ++u) {
      for (const Segment& seg : reduce[size_t(u)].plan.segments(r)) {
        for (int64_t i = 0; i < seg.numel; ++i) {
          float want = 0.0f;
          for (int k = 0; k < kWorld; ++k) want += grad_value(k, u, seg.param, seg.param_offset + i);
          const float got = reduce[size_t(u)].buffer.data_as<float>()[seg.partition_offset + i];
          if (std::abs(got - want) > 1e-4f * (1.0f + std::abs(want))) ++bad;
        }
      }
    }
  });
  CHECK(bad == 0);
}

// A delayed offload update reads one grad partition while the next backward
// reduces into another: set_grad_partitions redirects the reduction between
// backwards, leaves the old partition as it was, and refuses mid-backward.
void test_grad_partitions_change_between_backwards() {
  const std::vector<int64_t> numels = {17, 40, 5, 64};
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q) {
    const LayoutPlan plan = plan_of(numels);
    auto zeroed = [&] {
      Tensor t = Tensor::empty({plan.partition_elems()}, DType::kFloat32);
      std::fill(t.data_as<float>(), t.data_as<float>() + t.numel(), 0.0f);
      return t;
    };
    const Tensor first = zeroed(), second = zeroed();
    BucketReducer reducer(q, {FlatGroupBuffer{0, plan, first}}, DType::kFloat32, 2);
    auto backward = [&](float scale, bool try_mid_backward) {
      for (int p = 0; p < int(numels.size()); ++p) {
        Tensor g = Tensor::empty({numels[size_t(p)]}, DType::kFloat32);
        for (int64_t i = 0; i < g.numel(); ++i) g.data_as<float>()[i] = scale * grad_value(r, 0, p, i);
        reducer.grad_ready(0, p, g);
        if (try_mid_backward && p == 0) {
          bool threw = false;
          try {
            reducer.set_grad_partitions({zeroed()});
          } catch (const InvalidArgument&) {
            threw = true;
          }
          if (!threw) ++bad;
        }
      }
      reducer.end_backward();
    };
    backward(1.0f, false);
    bool threw = false;
    try {
      reducer.set_grad_partitions({Tensor::empty({plan.partition_elems() + 1}, DType::kFloat32)});
    } catch (const InvalidArgument&) {
      threw = true;
    }
    if (!threw) ++bad;
    reducer.set_grad_partitions({second});
    backward(3.0f, true);
    for (const Segment& seg : plan.segments(r)) {
      for (int64_t i = 0; i < seg.numel; ++i) {
        float want = 0.0f;
        for (int k = 0; k < kWorld; ++k) want += grad_value(k, 0, seg.param, seg.param_offset + i);
        const float got1 = first.data_as<float>()[seg.partition_offset + i];
        const float got2 = second.data_as<float>()[seg.partition_offset + i];
        if (std::abs(got1 - want) > 1e-4f * (1.0f + std::abs(want))) ++bad;
        if (std::abs(got2 - 3.0f * want) > 1e-4f * (1.0f + std::abs(want))) ++bad;
      }
    }
  });
  CHECK(bad == 0);
}

// Ranks that run different units, a different number of times (experts
// chosen by the data): rank 0 runs block 1 twice, rank 1 block 2, rank 2
// blocks 3 and 1, rank 3 none; nobody runs block 4. Every unit is gathered
// right where it runs, the schedule's rounds have every rank issue the same
// reductions (block 4's skipped), and the partitions hold the sum of the
// grads, zeros from the ranks that skipped.
void test_divergent_units() {
  constexpr int kUnits = 5;
  const std::vector<int64_t> numels = {20, 33};
  const std::vector<std::vector<int>> runs = {{1, 1}, {2}, {3, 1}, {}};
  std::vector<std::vector<CollectiveKey>> reductions(kWorld);  // per rank, its reduce-scatters in order
  std::atomic<int> bad{0};
  on_ranks([&](int r, CommQueue& q, CommQueue& rq) {
    std::vector<UnitSpec> specs(kUnits);
    specs[0].own_slot = true;
    std::vector<FlatGroupBuffer> reduce;  // reduction order: the last unit first
    for (int u = kUnits - 1; u >= 0; --u) {
      specs[size_t(u)].groups.push_back(unit_shard(u, 0, r, numels));
      FlatGroupBuffer rg{int32_t(u), plan_of(numels), Tensor()};
      rg.buffer = Tensor::empty({rg.plan.partition_elems()}, DType::kFloat32);
      std::fill(rg.buffer.data_as<float>(), rg.buffer.data_as<float>() + rg.buffer.numel(), 0.0f);
      reduce.push_back(rg);
    }
    BucketReducer reducer(q, reduce, DType::kFloat32, 2, /*on_request=*/true);
    const int64_t block_bytes = 4 * plan_of(numels).total_elems();
    UnitSchedule s(q, rq, specs, DType::kFloat32, block_bytes);
    std::vector<std::vector<int>> unit_groups;
    for (int u = 0; u < kUnits; ++u) unit_groups.push_back({kUnits - 1 - u});
    s.set_grad_reducer(&reducer, unit_groups);
    auto report_grads = [&](int u) {
      for (int p = 0; p < 2; ++p) {
        Tensor t = Tensor::empty({numels[size_t(p)]}, DType::kFloat32);
        for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = grad_value(r, u, p, i);
        reducer.grad_ready(kUnits - 1 - u, p, t);
      }
    };
    for (int step = 0; step < 2; ++step) {
      if (!holds_unit(s, specs, 0, s.pre_forward(0, false).buffer)) ++bad;
      for (int u : runs[size_t(r)]) {
        if (!holds_unit(s, specs, u, s.pre_forward(u, true).buffer)) ++bad;
        s.post_forward(u, true);
      }
      s.post_forward(0, true);
      s.end_forward();
      s.begin_backward();
      if (!holds_unit(s, specs, 0, s.pre_backward(0).buffer)) ++bad;
      for (auto u = runs[size_t(r)].rbegin(); u != runs[size_t(r)].rend(); ++u) {
        if (!holds_unit(s, specs, *u, s.pre_backward(*u).buffer)) ++bad;
        report_grads(*u);  // a unit run twice reports twice: its grads add up
        s.post_backward(*u);
      }
      report_grads(0);
      s.end_backward();
      for (int u = 0; u < kUnits; ++u) bad += s.gathered(u) ? 1 : 0;
      reducer.end_backward();
      s.end_step();
    }
    for (const CollectiveKey& k : q.trace()) {
      if (k.kind == CollectiveKind::kReduceScatter) reductions[size_t(r)].push_back(k);
    }
    for (int u = 0; u < kUnits; ++u) {
      const FlatGroupBuffer& rg = reduce[size_t(kUnits - 1 - u)];
      for (const Segment& seg : rg.plan.segments(r)) {
        for (int64_t i = 0; i < seg.numel; ++i) {
          float want = 0.0f;
          for (int k = 0; k < kWorld; ++k) {
            const auto& ran = runs[size_t(k)];
            const int times = u == 0 ? 1 : int(std::count(ran.begin(), ran.end(), u));
            want += float(times) * grad_value(k, u, seg.param, seg.param_offset + i);
          }
          want *= 2.0f;  // two steps
          const float got = rg.buffer.data_as<float>()[seg.partition_offset + i];
          if (std::abs(got - want) > 1e-4f * (1.0f + std::abs(want))) ++bad;
        }
      }
    }
  });
  CHECK(bad == 0);
  for (int r = 1; r < kWorld; ++r) CHECK(reductions[size_t(r)] == reductions[0]);
  // Per backward every unit's buckets once, block 4 (run nowhere) skipped.
  const int64_t buckets = int64_t(plan_of(numels).buckets().size());
  CHECK(int64_t(reductions[0].size()) == 2 * (kUnits - 1) * buckets);
  CHECK(std::none_of(reductions[0].begin(), reductions[0].end(), [](const CollectiveKey& k) { return k.group == 4; }));
}

}  // namespace

// The schedule on the checking backend (each rank its own, as each process
// its own). The hooks declare the compute stream's reads of every unit's
// params (the first after its gather, the last before its slot can be
// gathered into again): for three steps with prefetch they are ordered,
// with no violation. Two hook-level missing waits are named:
// - a read of a unit after its release, while the next unit is gathered
//   into its slot (declared by the test, as a stale hook would read): the
//   slot pool, the gather and the read;
// - a write into a unit's slot while it computes, on a stream of its own
//   that compute does not wait for (a queue over this rank alone): the
//   unit's post hook, whose declared last read is not ordered after it.
enum class Fault { kNone, kReadAfterRelease, kWriteWhileRead };

void test_units_on_the_checking_backend(Fault fault) {
  std::atomic<int> bad{0}, named{0};
  InProcessGroup data(kWorld, late_completion_from_env()), rounds(kWorld, late_completion_from_env());
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      CheckingCpuBackend backend(CheckingOptions{uint64_t(40 + r), 0, 200, false});
      Stream& compute = backend.compute_stream();
      CommQueue q(data.transport(r), backend), rq(rounds.transport(r), backend);
      CommQueue stray(InProcessGroup(1).transport(0), backend);
      std::vector<UnitSpec> specs(4);
      for (int u = 0; u < 4; ++u) specs[size_t(u)].groups.push_back(unit_shard(u, 0, r, {20, 33}));
      UnitSchedule s(q, rq, specs, DType::kFloat32, 4 * plan_of({20, 33}).total_elems());
      for (int step = 0; step < 3; ++step) {
        Tensor released;
        for (int u = 0; u < 4; ++u) {
          const Tensor buffer = s.pre_forward(u, true).buffer;
          if (!holds_unit(s, specs, u, buffer)) ++bad;
          if (step == 2 && u == 2 && fault == Fault::kReadAfterRelease) {
            backend.declare_access(compute, Access::read(released), "a stale read of unit 1");
          }
          if (step == 2 && u == 2 && fault == Fault::kWriteWhileRead) {
            const Tensor zeros = Tensor::empty({buffer.numel()}, DType::kFloat32);
            stray.all_gather(CollectiveKey{CollectiveKind::kAllGather, 99, 0, buffer.numel()}, zeros, buffer, false);
          }
          s.post_forward(u, true);
          released = buffer;
        }
        s.end_forward();
        s.begin_backward();
        for (int u = 3; u >= 0; --u) {
          if (!holds_unit(s, specs, u, s.pre_backward(u).buffer) && fault != Fault::kWriteWhileRead) ++bad;
          s.post_backward(u);
        }
        s.end_backward();
        s.end_step();
      }
      s.release_all();
      const std::vector<std::string> found = backend.violations();
      auto names = [&](const std::string& first, const std::string& then) {
        return std::any_of(found.begin(), found.end(), [&](const std::string& f) {
          return f.find(first) != std::string::npos && f.find(then) != std::string::npos;
        });
      };
      bool as_expected = found.empty();
      if (fault == Fault::kReadAfterRelease) {
        as_expected = !found.empty() &&
                      found[0].find("buffer 'gathered units' (device): 'all_gather of group 30") != std::string::npos &&
                      found[0].find("then 'a stale read of unit 1' on stream 'compute' reads") != std::string::npos;
      } else if (fault == Fault::kWriteWhileRead) {
        as_expected = names("buffer 'gathered units' (device): 'all_gather of group 99",
                            "then 'unit 2's forward ends reading its params' on stream 'compute' reads");
      }
      if (as_expected) {
        ++named;
      } else {
        for (const auto& f : found) std::fprintf(stderr, "rank %d: %s\n", r, f.c_str());
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(bad == 0);
  CHECK(named == kWorld);
}

// Each unit's states change only by the steps the schedule takes: a
// unit's lifetime goes through, any other step throws a logic_error that
// names the unit and the step, and leaves the state as it was.
void test_unit_state_steps() {
  Residency where = Residency::kReleased;
  for (Residency to : {Residency::kGathering, Residency::kGathered, Residency::kHeld, Residency::kGathered,
                       Residency::kHeld, Residency::kReleased}) {
    advance(7, where, to);
  }
  CHECK(where == Residency::kReleased);
  Grads grads = Grads::kNone;
  for (Grads to : {Grads::kComing, Grads::kReduced, Grads::kNone, Grads::kReduced, Grads::kNone}) advance(7, grads, to);
  CHECK(grads == Grads::kNone);

  auto refused = [](auto state, auto to, const std::string& says) {
    const auto before = state;
    try {
      advance(7, state, to);
    } catch (const std::logic_error& e) {
      const std::string what = e.what();
      return state == before && what.find("unit 7") != std::string::npos && what.find(says) != std::string::npos;
    }
    return false;
  };
  CHECK(refused(Residency::kGathered, Residency::kGathering, "params went from gathered to gathering"));
  CHECK(refused(Residency::kReleased, Residency::kHeld, "params went from released to held"));
  CHECK(refused(Residency::kGathering, Residency::kHeld, "from gathering to held"));
  CHECK(refused(Residency::kReleased, Residency::kReleased, "from released to released"));
  CHECK(refused(Grads::kReduced, Grads::kReduced, "grads went from reduced to reduced"));
  CHECK(refused(Grads::kReduced, Grads::kComing, "from reduced to coming"));
  CHECK(refused(Grads::kComing, Grads::kNone, "from coming to none"));
}

// A bucket's phase changes only by the steps the reducer takes: a backward
// with a late grad and one skipped goes through; any other step throws a
// logic_error naming the bucket and the step, leaving the phase as it was.
void test_bucket_phase_steps() {
  using P = BucketPhase;
  P phase = P::kEmpty;
  for (P to : {P::kStaging, P::kIssued, P::kLate, P::kStaging, P::kIssued, P::kEmpty, P::kIssued, P::kEmpty}) {
    advance("bucket 0 of group 1", phase, to);
  }
  CHECK(phase == P::kEmpty);
  auto refused = [](P phase, P to, const std::string& says) {
    const P before = phase;
    try {
      advance("bucket 2 of group 1", phase, to);
    } catch (const std::logic_error& e) {
      const std::string what = e.what();
      return phase == before && what.find("bucket 2 of group 1 went from " + says) != std::string::npos;
    }
    return false;
  };
  CHECK(refused(P::kEmpty, P::kLate, "empty to late"));
  CHECK(refused(P::kIssued, P::kStaging, "issued to staging"));
  CHECK(refused(P::kLate, P::kEmpty, "late to empty"));
  CHECK(refused(P::kIssued, P::kIssued, "issued to issued"));
  CHECK(refused(P::kEmpty, P::kEmpty, "empty to empty"));
}

int main() {
  test_unit_state_steps();
  test_bucket_phase_steps();
  test_units();
  test_units_on_the_checking_backend(Fault::kNone);
  test_units_on_the_checking_backend(Fault::kReadAfterRelease);
  test_units_on_the_checking_backend(Fault::kWriteWhileRead);
  test_buckets();
  test_grad_views_as_buckets_take_staging();
  test_in_flight_reduction_gives_its_staging_back();
  test_grad_partitions_change_between_backwards();
  test_divergent_units();
  return test::finish("test_schedule");
}
