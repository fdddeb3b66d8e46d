// EngineCore (engine/engine_core.h): the parts it builds at each stage
// from the stores, the units and the placement; one SGD step at stages 0-2
// on two thread ranks (a frozen group beside a trainable one), its full
// params checked against the same step written out in double; stage 3's
// groups kept whole gathered by the step; a test-only reduction order that
// rebuilds the reducer the step then uses; the offload swap followed by
// the store and then the reducer; and each refusal of a bad
// description, naming what is wrong. (Stage 3 training runs in
// cpp/examples/embed_zero.cpp, which builds its runtime through the core.)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "thread_ranks.h"
#include "zerocore/engine/engine_core.h"
#include "zerocore/zerocore.h"

namespace zerocore {
namespace {

constexpr int kWorld = 2;
constexpr double kLr = 0.1;
const std::vector<int64_t> kNumels = {37, 64, 10};

// Stage 0's plans are of one rank (every rank updates everything).
LayoutPlan plan_of(int stage) {
  std::vector<ParamSpec> specs;
  for (int64_t n : kNumels) specs.push_back(ParamSpec{n, 0});
  return LayoutPlan::make(specs, LayoutOptions{stage == 0 ? 1 : kWorld, 4, 48});
}

// A store of plan_of(stage) for `stage`, allocated (params zero).
std::unique_ptr<PartitionStore> store_of(int stage, int rank, bool trainable = true, bool sharded_at_3 = true) {
  StorePlacement p;
  p.rank = stage == 0 ? 0 : rank;
  p.trainable = trainable;
  p.sharded = stage == 3 && sharded_at_3;
  p.partitions_grads = stage >= 2;
  auto s = std::make_unique<PartitionStore>(plan_of(stage), p, default_cpu_backend());
  s->allocate();
  return s;
}

// Rank r's grad of param i, the same on every thread.
std::vector<float> grad_of(int rank, int param) {
  std::mt19937 rng(99u + 7u * unsigned(rank) + unsigned(param));
  std::normal_distribution<float> normal;
  std::vector<float> out(size_t(kNumels[size_t(param)]));
  for (float& x : out) x = normal(rng);
  return out;
}

float initial(int param, int64_t i) { return 0.5f * float(param) + 0.01f * float(i % 23) - 0.1f; }

Tensor filled(const std::vector<float>& values) {
  Tensor t = Tensor::empty({int64_t(values.size())}, DType::kFloat32);
  std::memcpy(t.data(), values.data(), t.nbytes());
  return t;
}

StepOptions sgd() {
  StepOptions o;
  o.kind = OptimizerKind::kSgd;
  o.sgd = {SgdOptions{kLr, 0.0, 0.0, 0.0, false}};
  return o;
}

// Whether f throws InvalidArgument whose message holds `says`.
bool refuses(const std::function<void()>& f, const std::string& says) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    if (std::string(e.what()).find(says) != std::string::npos) return true;
    std::fprintf(stderr, "refused, but with: %s\n", e.what());
    return false;
  }
  std::fprintf(stderr, "not refused (expected \"%s\")\n", says.c_str());
  return false;
}

// At stages 0-2: group 0 trainable, group 1 frozen. Each rank's grads go
// where its stage takes them, one step of SGD, and every rank's full params
// of the trainable group must be p - lr * mean over ranks of the grads;
// the frozen group's stay.
void step_matches_reference(int stage) {
  test::on_ranks(kWorld, [&](int r, CommQueue& q) {
    auto trained = store_of(stage, r), frozen = store_of(stage, r, /*trainable=*/false);
    for (PartitionStore* s : {trained.get(), frozen.get()}) {
      for (int i = 0; i < int(kNumels.size()); ++i) {
        float* v = s->param_view("full", i).data_as<float>();
        for (int64_t k = 0; k < kNumels[size_t(i)]; ++k) v[k] = initial(i, k);
      }
    }
    EngineCore::Description d;
    d.queues = {&q, &q, nullptr, nullptr};
    d.groups = {{trained.get(), 0, {}}, {frozen.get(), 1, {}}};
    d.stage = stage;
    EngineCore core(d);
    CHECK((core.grad_reduce() != nullptr) == (stage <= 1));
    CHECK((core.param_gather() != nullptr) == (stage >= 1));
    CHECK((core.reducer() != nullptr) == (stage >= 2));
    CHECK(core.schedule() == nullptr);
    CHECK(core.host_update() == nullptr);
    if (stage == 2) {  // staging as planned: two, and the most buckets one param spans
      int span = 0;
      for (const ParamSlot& slot : plan_of(2).params()) span = std::max(span, slot.last_bucket - slot.first_bucket + 1);
      CHECK(span > 1 && core.reducer()->staging_slots() == 2 + span);
    }
    for (int i = 0; i < int(kNumels.size()); ++i) {
      const Tensor grad = filled(grad_of(r, i));
      if (stage >= 2) {
        core.reducer()->grad_ready(0, i, grad);
      } else {
        std::memcpy(trained->param_view("grad_full", i).data(), grad.data(), grad.nbytes());
      }
    }
    if (core.reducer()) core.reducer()->end_backward();
    const StepResult out = core.step(sgd());
    CHECK(out.applied);
    int wrong = 0;
    for (int i = 0; i < int(kNumels.size()); ++i) {
      const std::vector<float> g0 = grad_of(0, i), g1 = grad_of(1, i);
      const float* got = trained->param_view("full", i).data_as<float>();
      const float* still = frozen->param_view("full", i).data_as<float>();
      for (int64_t k = 0; k < kNumels[size_t(i)]; ++k) {
        const double want = double(initial(i, k)) - kLr * (double(g0[size_t(k)]) + double(g1[size_t(k)])) / kWorld;
        if (std::abs(double(got[k]) - want) > 1e-5 && ++wrong == 1) {
          std::fprintf(stderr, "stage %d, rank %d, param %d[%lld]: %g, want %g\n", stage, r, i, (long long)k,
                       double(got[k]), want);
        }
        CHECK(still[k] == initial(i, k));
      }
    }
    CHECK(wrong == 0);
  });
}

// Stage 3: a sharded group in the one unit and a group kept whole (under
// the persist threshold) beside it; the core gathers the whole one after
// the update (param_gather), the unit is the schedule's.
void stage3_parts() {
  test::on_ranks_with_rounds(kWorld, [&](int r, CommQueue& q, CommQueue& rounds) {
    auto sharded = store_of(3, r), whole = store_of(3, r, true, /*sharded_at_3=*/false);
    EngineCore::Description d;
    d.queues = {&q, &q, nullptr, &rounds};
    d.groups = {{sharded.get(), 0, {}}, {whole.get(), 1, {}}};
    d.units = {{{0}, true}};
    d.stage = 3;
    EngineCore core(d);
    CHECK(core.schedule() != nullptr);
    CHECK(core.reducer() != nullptr && core.reducer()->on_request());
    CHECK(core.reducer()->num_groups() == 2);
    CHECK(core.param_gather() != nullptr);
    CHECK(core.grad_reduce() == nullptr);
    CHECK(core.schedule()->unit_elems(0) == plan_of(3).total_elems());
    // Staging as planned: the root unit's buckets (no other unit's).
    CHECK(core.reducer()->staging_slots() == int(plan_of(3).buckets().size()));
    const BucketReducer* before = core.reducer();
    core.set_reduction_order({{1, 1}, {0, 0}});
    CHECK(core.reducer() != before && core.reducer()->num_groups() == 2);
  });
}

// A test-only reduction order: the reducer is rebuilt over the groups in
// that order and the step reduces through it (stage 2, two trainable
// groups reduced in the other order on both ranks: the step still agrees).
void reduction_order() {
  test::on_ranks(kWorld, [&](int r, CommQueue& q) {
    auto a = store_of(2, r), b = store_of(2, r);
    EngineCore::Description d;
    d.queues = {&q, &q, nullptr, nullptr};
    d.groups = {{a.get(), 0, {}}, {b.get(), 1, {}}};
    d.stage = 2;
    EngineCore core(d);
    const BucketReducer* before = core.reducer();
    core.set_reduction_order({{1, 1}, {0, 0}});
    CHECK(core.reducer() != before);
    // Place 0 is now group 1 (store b): its grads land in b's partition.
    for (int i = 0; i < int(kNumels.size()); ++i) core.reducer()->grad_ready(0, i, filled(grad_of(r, i)));
    core.reducer()->end_backward();
    CHECK(core.step(sgd()).applied);
    bool a_moved = false, b_moved = false;
    for (int i = 0; i < int(kNumels.size()); ++i) {
      const Tensor pa = a->param_view("full", i), pb = b->param_view("full", i);
      for (int64_t k = 0; k < pa.numel(); ++k) {
        a_moved = a_moved || pa.data_as<float>()[k] != 0.0f;
        b_moved = b_moved || pb.data_as<float>()[k] != 0.0f;
      }
    }
    CHECK(!a_moved && b_moved);
    CHECK(refuses([&] { core.set_reduction_order({{0, 0}, {0, 0}}); }, "named once"));
    CHECK(refuses([&] { core.set_reduction_order({{1, 1}}); }, "names 1 groups, of 2"));
  });
}

// Offload with a delayed update at stage 2 (one rank): the step's host
// update swaps the host grads with the buffer reduction fills; the core
// swaps the store's buffers in the same call and points the reducer at the
// new grad partition at the next before_backward, so the next backward's
// grads land there and not in the buffer the pending update reads.
void offload_swap() {
  Backend& backend = default_cpu_backend();
  CommQueue q(backend, StreamPlane::kDevice);
  StorePlacement p;
  p.partitions_grads = p.optimizer_on_host = p.delayed = true;
  PartitionStore store(LayoutPlan::make({{37, 0}, {10, 0}}, LayoutOptions{1, 4, 48}), p, backend);
  store.allocate();
  CHECK(store.swaps_grads());
  // The host update's buckets, as python/zerocore/state/offload.py makes them.
  std::vector<OffloadBucket> buckets(store.plan().buckets().size());
  const std::vector<FlatRun> runs = store.flat_runs();
  for (int k = 0; k < int(runs.size()); ++k) {
    OffloadBucket& b = buckets[size_t(store.runs()[size_t(k)].bucket)];
    b.runs.push_back(runs[size_t(k)]);
    b.params_up.push_back({store.run_view("master", k), store.run_view("full", k)});
    b.spare_grads.push_back(store.run_view("grad_part", k));
  }
  OffloadOptimizer host(std::move(buckets), backend);
  EngineCore::Description d;
  d.queues = {&q, &q, nullptr, nullptr};
  d.groups = {{&store, 0, {}}};
  d.stage = 2;
  d.offload = &host;
  d.delays_from = 1;
  EngineCore core(d);
  CHECK(core.host_update() != nullptr && core.param_gather() != nullptr);
  auto backward = [&](float value) {
    for (int i = 0; i < 2; ++i) {
      core.before_backward();
      core.reducer()->grad_ready(0, i, filled(std::vector<float>(size_t(i == 0 ? 37 : 10), value)));
    }
    core.reducer()->end_backward();
  };
  backward(1.0f);
  const void* filled_by_reduction = store.buffer("grad_part").data();
  const void* read_by_update = store.buffer("host_grad").data();
  CHECK(core.step(sgd()).applied);
  CHECK(core.host_update()->grad_swaps() == 1 && core.follow_swaps() == 0);  // step() followed it
  CHECK(store.buffer("grad_part").data() == read_by_update);
  CHECK(store.buffer("host_grad").data() == filled_by_reduction);
  CHECK(core.reducer()->partitions()[0].data() == filled_by_reduction);  // until the next backward
  backward(2.0f);
  CHECK(core.reducer()->partitions()[0].data() == read_by_update);
  const float* next = store.param_view("grad_part", 0).data_as<float>();
  const float* pending = store.param_view("host_grad", 0).data_as<float>();
  CHECK(next[0] == 2.0f && pending[0] == 1.0f);
  CHECK(core.step(sgd()).applied);
  CHECK(core.host_update()->grad_swaps() == 2 && store.buffer("grad_part").data() == filled_by_reduction);
  core.host_update()->params_up();
}

// Each bad description is refused before anything is built, naming it.
void refusals() {
  Backend& backend = default_cpu_backend();
  CommQueue q(backend, StreamPlane::kDevice), rounds(backend, StreamPlane::kControl);
  // One rank alone: plans of world size 1.
  auto store = [&](bool trainable, bool sharded, bool partitions_grads, bool allocate = true) {
    StorePlacement p;
    p.trainable = trainable;
    p.sharded = sharded;
    p.partitions_grads = partitions_grads;
    auto s = std::make_unique<PartitionStore>(LayoutPlan::make({{37, 0}, {10, 0}}, LayoutOptions{1, 4, 48}), p,
                                              backend);
    if (allocate) s->allocate();
    return s;
  };
  auto s2 = store(true, false, true), s3 = store(true, true, true), s1 = store(true, false, false);
  auto describe = [&](int stage, std::vector<EngineCore::Group> groups) {
    EngineCore::Description d;
    d.queues = {&q, &q, nullptr, &rounds};
    d.groups = std::move(groups);
    d.stage = stage;
    return d;
  };
  auto build = [](const EngineCore::Description& d) { return [d] { EngineCore core(d); }; };

  CHECK(refuses(build(describe(4, {})), "stage 4"));
  EngineCore::Description d = describe(2, {{s2.get(), 0, {}}});
  d.queues.data = nullptr;
  CHECK(refuses(build(d), "no data queue"));
  d = describe(2, {{s2.get(), 0, {}}});
  d.queues.control = nullptr;
  CHECK(refuses(build(d), "no control queue"));
  d = describe(3, {{s3.get(), 0, {}}});
  d.units = {{{0}, true}};
  d.queues.rounds = nullptr;
  CHECK(refuses(build(d), "queue for its rounds"));
  d = describe(2, {{s2.get(), 0, {}}});
  d.staging_buffers = -1;
  CHECK(refuses(build(d), "staging_buffers -1"));
  d = describe(2, {{nullptr, 0, {}}});
  CHECK(refuses(build(d), "group 0 (tag 0) has no store"));
  auto unallocated = store(true, false, true, /*allocate=*/false);
  CHECK(refuses(build(describe(2, {{unallocated.get(), 5, {}}})), "group 0 (tag 5)'s store is not allocated"));
  // Stores placed for another stage.
  CHECK(refuses(build(describe(1, {{s2.get(), 0, {}}})), "partitions the grads, unlike stage 1"));
  CHECK(refuses(build(describe(2, {{s1.get(), 3, {}}})), "group 0 (tag 3): its store does not partition the grads"));
  CHECK(refuses(build(describe(2, {{s3.get(), 0, {}}})), "shards the params, unlike stage 2"));
  // Plans of another world size than the data queue's (stage 0: of one rank).
  CHECK(refuses(build(describe(2, {{store_of(2, 0).get(), 0, {}}})), "partitions over 2 ranks, the data queue has 1"));
  test::on_ranks(kWorld, [&](int r, CommQueue& q2) {
    auto planned_for_2 = store_of(1, r);
    EngineCore::Description d0;
    d0.queues = {&q2, &q2, nullptr, nullptr};
    d0.groups = {{planned_for_2.get(), 0, {}}};
    CHECK(refuses(build(d0), "at stage 0 every rank updates all of it"));
  });
  // Offload: an optimizer at stage 0, and stores placed with or without one unlike the core.
  OffloadOptimizer host({}, backend);
  d = describe(0, {});
  d.offload = &host;
  CHECK(refuses(build(d), "an offload optimizer at stage 0"));
  d = describe(2, {{s2.get(), 0, {}}});
  d.offload = &host;
  CHECK(refuses(build(d), "keeps the optimizer where training runs, the core has an offload optimizer"));
  // Units.
  d = describe(2, {{s2.get(), 0, {}}});
  d.units = {{{0}, true}};
  CHECK(refuses(build(d), "only stage 3 has units"));
  d = describe(3, {{s3.get(), 0, {}}});
  d.units = {{{1}, true}};
  CHECK(refuses(build(d), "unit 0 names group 1 of 1"));
  d = describe(3, {{s3.get(), 0, {}}});
  CHECK(refuses(build(d), "sharded but in no unit"));
  d = describe(3, {{s3.get(), 0, {}}});
  d.units = {{{0}, true}, {{0}, false}};
  CHECK(refuses(build(d), "is in unit 0 and unit 1"));
  StorePlacement bf16_shard;
  bf16_shard.sharded = bf16_shard.partitions_grads = true;
  bf16_shard.dtype = DType::kBFloat16;
  PartitionStore s3_bf16(LayoutPlan::make({{37, 0}}, LayoutOptions{1, 4, 48}), bf16_shard, backend);
  s3_bf16.allocate();
  d = describe(3, {{s3.get(), 0, {}}, {&s3_bf16, 1, {}}});
  d.units = {{{0}, true}, {{1}, false}};
  CHECK(refuses(build(d), "group 1 (tag 1) holds bfloat16, an earlier unit group float32"));
  auto whole3 = store(true, false, true);
  d = describe(3, {{whole3.get(), 0, {}}});
  d.units = {{{0}, true}};
  CHECK(refuses(build(d), "keeps its params whole"));
  // Buffers to reduce into (Config(deterministic=True)'s sums).
  auto other = store(true, false, true);
  const Tensor sums = Tensor::empty({s2->buffer("grad_part").numel()}, DType::kInt64);
  CHECK(refuses(build(describe(2, {{s2.get(), 0, sums}, {other.get(), 1, {}}})), "all or none"));
  CHECK(refuses(build(describe(2, {{s2.get(), 0, Tensor::empty({3}, DType::kInt64)}})), "has 3 elements"));
  auto frozen = store(false, false, true);
  CHECK(refuses(build(describe(2, {{frozen.get(), 0, sums}})), "is frozen"));
  StorePlacement half;
  half.partitions_grads = true;
  half.reduce_dtype = DType::kBFloat16;
  PartitionStore bf16(LayoutPlan::make({{37, 0}}, LayoutOptions{1, 4, 48}), half, backend);
  bf16.allocate();
  CHECK(refuses(build(describe(2, {{s2.get(), 0, {}}, {&bf16, 1, {}}})), "one reduce dtype for all"));
  // The reduction order.
  d = describe(1, {{s1.get(), 0, {}}});
  d.reduction_order = {{0, 0}};
  CHECK(refuses(build(d), "only stages 2-3 have one"));
  d = describe(2, {{s2.get(), 0, {}}, {frozen.get(), 1, {}}});
  d.reduction_order = {{1, 1}};
  CHECK(refuses(build(d), "names group 1, which is not a trainable group"));
  // A good description builds.
  EngineCore core(describe(2, {{s2.get(), 0, {}}, {frozen.get(), 1, {}}}));
  CHECK(core.reducer()->num_groups() == 1);
}

}  // namespace
}  // namespace zerocore

int main() {
  for (int stage : {0, 1, 2}) zerocore::step_matches_reference(stage);
  zerocore::stage3_parts();
  zerocore::reduction_order();
  zerocore::offload_swap();
  zerocore::refusals();
  return zerocore::test::finish("test_engine_core");
}
