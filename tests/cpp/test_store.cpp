// The partition store against a layout computed here element by element:
// each param element's flat position and owning rank from the layout rules
// alone (aligned starts, constant buckets split evenly over the ranks), over
// uneven sizes, empty params, padding, world sizes 1-4 and many buckets.
// Buffers hold a label per element, so a view that lands one element off,
// on padding or on another rank's block reads the wrong label. The store's
// buffers are its backend's, of the kind its placement puts them in, and
// the checking backend checks accesses to them.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "zerocore/backend/checking_backend.h"
#include "zerocore/error.h"
#include "zerocore/kernels/cpu_accumulate.h"
#include "zerocore/kernels/element_math.h"
#include "zerocore/store/partition_store.h"

using namespace zerocore;

namespace {

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

float label(int param, int64_t k) { return float(param * 4096 + k + 1); }  // 0: padding

// Where every element lives, by brute force over the flat buffer.
struct Reference {
  std::vector<int64_t> offset;  // per param
  std::vector<float> whole;     // labels
  int64_t bucket = 0, total = 0;

  Reference(const std::vector<ParamSpec>& specs, const LayoutOptions& o) {
    int64_t end = 0;
    for (const ParamSpec& s : specs) {
      offset.push_back(round_up(end, o.align_elems));
      end = offset.back() + s.numel;
    }
    const int64_t unit = o.world_size * o.align_elems;
    bucket = o.bucket_elems == 0 ? round_up(end, unit) : round_up(o.bucket_elems, unit);
    total = end == 0 ? 0 : (end - 1) / bucket * bucket + round_up(end - (end - 1) / bucket * bucket, unit);
    whole.assign(size_t(total), 0.f);
    for (size_t i = 0; i < specs.size(); ++i) {
      for (int64_t k = 0; k < specs[i].numel; ++k) whole[size_t(offset[i] + k)] = label(int(i), k);
    }
  }
  int64_t bucket_size(int64_t e) const { return std::min(bucket, total - e / bucket * bucket); }
  int owner(int64_t e, int world) const { return int(e % bucket / (bucket_size(e) / world)); }
  // The labels of rank's partition: its blocks in flat order.
  std::vector<float> partition(int rank, int world) const {
    std::vector<float> out;
    for (int64_t e = 0; e < total; ++e) {
      if (owner(e, world) == rank) out.push_back(whole[size_t(e)]);
    }
    return out;
  }
};

Tensor filled(const std::vector<float>& values) {
  Tensor t = Tensor::empty({int64_t(values.size())}, DType::kFloat32);
  for (size_t i = 0; i < values.size(); ++i) t.data_as<float>()[i] = values[i];
  return t;
}

std::vector<float> values(const Tensor& t) { return {t.data_as<float>(), t.data_as<float>() + t.numel()}; }

// The elements of buf at s: how a caller with its own tensors reads a span.
Tensor at(const Tensor& buf, Span s) { return buf.slice(s.offset, s.numel); }

template <typename F>
bool throws(F f) {
  try {
    f();
  } catch (const InvalidArgument&) {
    return true;
  }
  return false;
}

void check_views(const std::vector<ParamSpec>& specs, const LayoutOptions& o) {
  const LayoutPlan plan = LayoutPlan::make(specs, o);
  const Reference ref(specs, o);
  CHECK(plan.total_elems() == ref.total);
  const Tensor whole = filled(ref.whole);
  std::vector<std::vector<int>> seen(specs.size());  // per param element: ranks holding it
  for (size_t i = 0; i < specs.size(); ++i) seen[i].assign(size_t(specs[i].numel), 0);

  for (int r = 0; r < o.world_size; ++r) {
    StorePlacement place;
    place.rank = r;
    const PartitionStore store(plan, place, default_cpu_backend());
    const std::vector<float> expected = ref.partition(r, o.world_size);
    CHECK(int64_t(expected.size()) == plan.partition_elems());
    const Tensor part = filled(expected);

    for (size_t i = 0; i < specs.size(); ++i) {
      const Tensor p = store.param_view(whole, int(i));
      CHECK(p.numel() == specs[i].numel);
      for (int64_t k = 0; k < p.numel(); ++k) CHECK(p.data_as<float>()[k] == label(int(i), k));
      for (const auto& [first, view] : store.param_stretches(part, int(i))) {
        for (int64_t k = 0; k < view.numel(); ++k) {
          CHECK(view.data_as<float>()[k] == label(int(i), first + k));
          ++seen[i][size_t(first + k)];
          CHECK(ref.owner(ref.offset[i] + first + k, o.world_size) == r);
        }
      }
    }
    for (int b = 0; b < int(plan.buckets().size()); ++b) {
      const Span shard = store.shard_span(whole.numel(), b, r);
      CHECK(values(at(part, store.bucket_span(part.numel(), b))) == values(at(whole, shard)));
      const Tensor bucket = at(whole, store.bucket_span(whole.numel(), b));
      CHECK(bucket.data_as<float>() - whole.data_as<float>() == int64_t(b) * ref.bucket);
      CHECK(bucket.numel() == ref.bucket_size(int64_t(b) * ref.bucket));
    }
    // Runs: one bucket and one optimizer group each, the same elements in
    // the whole and the partition, together every element of the rank's
    // params in partition order.
    std::vector<float> in_runs;
    for (int k = 0; k < int(store.runs().size()); ++k) {
      const PartitionRun& run = store.runs()[k];
      const std::vector<float> v = values(at(part, store.run_span(part.numel(), k)));
      CHECK(v == values(at(whole, store.run_span(whole.numel(), k))));
      for (float x : v) {
        if (x == 0.f) continue;
        in_runs.push_back(x);
        const int param = int(x - 1) / 4096;
        CHECK(specs[size_t(param)].param_group == run.param_group);
        CHECK((ref.offset[size_t(param)] + int64_t(x - 1) % 4096) / ref.bucket == run.bucket);
      }
      if (k > 0) {
        const PartitionRun& prev = store.runs()[k - 1];
        CHECK(prev.bucket != run.bucket || prev.param_group != run.param_group);
      }
    }
    std::vector<float> labels;
    for (float x : expected) {
      if (x != 0.f) labels.push_back(x);
    }
    CHECK(in_runs == labels);
  }
  for (const auto& counts : seen) {
    for (int c : counts) CHECK(c == 1);  // every element on exactly one rank
  }
}

void sweep() {
  std::mt19937 rng(20);
  for (int world = 1; world <= 4; ++world) {
    for (int64_t align : {1, 4}) {
      for (int64_t bucket : {0, 7, 16, 64}) {
        for (int trial = 0; trial < 6; ++trial) {
          std::vector<ParamSpec> specs(1 + rng() % 6);
          for (ParamSpec& s : specs) s = ParamSpec{int64_t(rng() % 40), int(rng() % 2)};
          check_views(specs, LayoutOptions{world, align, bucket});
        }
      }
    }
  }
}

std::vector<std::string> kinds(const PartitionStore& s) {
  std::vector<std::string> out;
  for (const BufferSpec& b : s.buffers()) out.push_back(b.kind);
  return out;
}

// What each stage keeps, its sizes and places, allocation and the grad swap.
void placements() {
  const LayoutPlan plan = LayoutPlan::make({{30, 0}, {11, 1}}, LayoutOptions{2, 4, 16});
  const int64_t whole = plan.total_elems(), part = plan.partition_elems();
  StorePlacement p;
  p.rank = 1;
  p.dtype = DType::kBFloat16;
  p.state_names = {"exp_avg", "exp_avg_sq"};
  {  // stage 1, bf16
    const PartitionStore s(plan, p, default_cpu_backend());
    CHECK((kinds(s) == std::vector<std::string>{"full", "master", "state.exp_avg", "state.exp_avg_sq", "grad_full"}));
    CHECK(s.planned_bytes(Where::kDevice) == size_t(whole * 2 + part * 4 * 3 + whole * 4));
    CHECK(s.planned_bytes(Where::kHost) == 0);
  }
  p.sharded = p.partitions_grads = p.params_on_host = p.optimizer_on_host = true;
  p.reduce_dtype = DType::kBFloat16;
  {  // stage 3, everything offloaded: host_grad is grad_part
    PartitionStore s(plan, p, default_cpu_backend());
    CHECK((kinds(s) ==
           std::vector<std::string>{"shard", "master", "state.exp_avg", "state.exp_avg_sq", "grad_part", "host_param"}));
    CHECK(s.planned_bytes(Where::kDevice) == 0);
    CHECK(s.planned_bytes(Where::kHost) == size_t(part * (2 + 12 + 2 + 2)));
    CHECK(throws([&] { s.buffer("shard"); }));  // before allocate
    s.allocate();
    CHECK(s.has("host_grad") && !s.swaps_grads());
    CHECK(s.buffer("host_grad").data() == s.buffer("grad_part").data());
    for (const BufferSpec& b : s.buffers()) {
      const Tensor t = s.buffer(b.kind);
      CHECK(t.numel() == b.elems && t.dtype() == b.dtype && t.nbytes() == b.bytes());
    }
    CHECK(throws([&] { s.buffer("grad_full"); }));
    CHECK(throws([&] { s.allocate(); }));
    CHECK(throws([&] { s.swap_grads(); }));
  }
  p.delayed = true;
  {  // delayed: two host grad buffers that trade places
    PartitionStore s(plan, p, default_cpu_backend());
    s.allocate();
    CHECK(s.swaps_grads());
    void* const a = s.buffer("grad_part").data();
    void* const b = s.buffer("host_grad").data();
    CHECK(a != b);
    s.swap_grads();
    CHECK(s.buffer("grad_part").data() == b && s.buffer("host_grad").data() == a);
    CHECK(s.run_view("host_grad", 0).data() == a);
  }
  p.trainable = false;
  {
    const PartitionStore s(plan, p, default_cpu_backend());
    CHECK(kinds(s) == std::vector<std::string>{"shard"} && s.runs().empty());
  }
}

// The step's runs (flat_runs) view the buffers the store's table says the
// update reads and writes, per placement: kinds = {param, grad, state0,
// state1, param_copy}, "" where there is none.
void check_step_runs(const LayoutPlan& plan, const StorePlacement& p, const std::vector<std::string>& kinds) {
  PartitionStore s(plan, p, default_cpu_backend());
  s.allocate();
  const std::vector<FlatRun> runs = s.flat_runs();
  CHECK(runs.size() == s.runs().size() && (runs.empty() != p.trainable));
  for (int k = 0; k < int(runs.size()); ++k) {
    const FlatRun& r = runs[size_t(k)];
    CHECK(r.param_group == s.runs()[size_t(k)].param_group);
    const Tensor* got[] = {&r.param, &r.grad, &r.state0, &r.state1, &r.param_copy};
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (kinds[i].empty()) {
        CHECK(got[i]->data() == nullptr);
        continue;
      }
      const Tensor want = s.run_view(kinds[i], k);
      CHECK(got[i]->data() == want.data() && got[i]->numel() == want.numel() && got[i]->dtype() == want.dtype());
    }
  }
}

void step_runs() {
  const LayoutPlan plan = LayoutPlan::make({{30, 0}, {11, 1}, {5, 1}}, LayoutOptions{2, 4, 16});
  StorePlacement p;
  p.rank = 1;
  p.state_names = {"exp_avg", "exp_avg_sq"};
  // Stage 2, fp32: the params training reads are the update's, no copy.
  p.partitions_grads = true;
  check_step_runs(plan, p, {"full", "grad_part", "state.exp_avg", "state.exp_avg_sq", ""});
  // Stage 3, bf16: the fp32 master is updated and copied into the shard.
  p.sharded = true;
  p.dtype = DType::kBFloat16;
  check_step_runs(plan, p, {"master", "grad_part", "state.exp_avg", "state.exp_avg_sq", "shard"});
  // Stage 1, SGD with momentum: one state; the grads reduction leaves are whole.
  p.sharded = p.partitions_grads = false;
  p.state_names = {"momentum_buffer"};
  check_step_runs(plan, p, {"master", "grad_full", "state.momentum_buffer", "", "full"});
  // Offloaded, stage 3: the host's grads (the grad partition itself here) and its 16-bit copy.
  p.sharded = p.partitions_grads = p.params_on_host = p.optimizer_on_host = true;
  check_step_runs(plan, p, {"master", "grad_part", "state.momentum_buffer", "", "host_param"});
  p.delayed = true;  // with a host grad buffer of its own
  check_step_runs(plan, p, {"master", "host_grad", "state.momentum_buffer", "", "host_param"});
  p.trainable = false;
  check_step_runs(plan, p, {});
  // A buffer handed out with the plan and the tag, for the collectives.
  PartitionStore s(plan, p, default_cpu_backend());
  s.allocate();
  const FlatGroupBuffer shard = s.group_buffer(7, "shard");
  CHECK(shard.tag == 7 && shard.buffer.data() == s.buffer("shard").data() &&
        shard.buffer.numel() == plan.partition_elems() && shard.plan.total_elems() == plan.total_elems() &&
        shard.plan.buckets().size() == plan.buckets().size());
  CHECK(throws([&] { s.group_buffer(7, "full"); }));
}

// zero_grads zeroes the grads reduction adds into, device or host memory,
// and nothing else.
void zeroing() {
  const LayoutPlan plan = LayoutPlan::make({{30, 0}, {11, 1}}, LayoutOptions{2, 4, 16});
  StorePlacement p;
  p.rank = 1;
  p.dtype = DType::kBFloat16;
  p.state_names = {"exp_avg"};
  for (int offloaded = 0; offloaded < 2; ++offloaded) {
    // Stage 1 (grad_full on the device), or stage 2 offloaded with a delayed
    // update (grad_part and a host_grad of its own on the host).
    p.partitions_grads = p.optimizer_on_host = p.delayed = offloaded == 1;
    PartitionStore s(plan, p, default_cpu_backend());
    s.allocate();
    for (const BufferSpec& b : s.buffers()) std::memset(s.buffer(b.kind).data(), 1, b.bytes());
    s.zero_grads();
    for (const BufferSpec& b : s.buffers()) {
      const Tensor t = s.buffer(b.kind);
      const auto* bytes = static_cast<const unsigned char*>(t.data());
      const unsigned char want = b.kind == "grad_full" || b.kind == "grad_part" ? 0 : 1;
      CHECK(std::all_of(bytes, bytes + t.nbytes(), [want](unsigned char c) { return c == want; }));
    }
  }
}

// exact_sums (Config(deterministic=True) at stages 2-3): grad_part's memory
// is 5 bytes an element, all of it the int40 sums, the grads its first
// bytes; int64 adds into them exactly across the whole 40-bit range;
// refused where the grads are whole or on the host.
void exact_sums() {
  const LayoutPlan plan = LayoutPlan::make({{30, 0}, {11, 1}}, LayoutOptions{2, 4, 16});
  StorePlacement p;
  p.rank = 1;
  p.reduce_dtype = DType::kBFloat16;
  p.partitions_grads = p.sharded = p.exact_sums = true;
  PartitionStore s(plan, p, default_cpu_backend());
  StorePlacement plain = p;
  plain.exact_sums = false;
  const size_t without = PartitionStore(plan, plain, default_cpu_backend()).planned_bytes(Where::kDevice);
  CHECK(s.planned_bytes(Where::kDevice) == without + size_t(plan.partition_elems()) * (5 - 2));
  CHECK(throws([&] { s.buffer("grad_sums"); }));  // before allocate()
  s.allocate();
  const Tensor sums = s.buffer("grad_sums"), grads = s.buffer("grad_part");
  CHECK(s.has("grad_sums") && sums.dtype() == DType::kInt40 && sums.numel() == plan.partition_elems());
  // Values near 2**38 of either sign, added twice: sums near +-2**39, exact.
  const Tensor step = Tensor::empty({sums.numel()}, DType::kInt64);
  for (int64_t i = 0; i < step.numel(); ++i) step.data_as<int64_t>()[i] = ((int64_t(1) << 38) - 1 - 3 * i) * (i % 2 ? -1 : 1);
  accumulate(sums, step);
  accumulate(sums, step);
  bool exact = true;
  for (int64_t i = 0; i < step.numel(); ++i) {
    exact &= kernels::load_int40(static_cast<const uint8_t*>(sums.data()) + 5 * i) == 2 * step.data_as<int64_t>()[i];
  }
  CHECK(exact);
  CHECK(sums.data() == grads.data() && grads.dtype() == DType::kBFloat16 && grads.numel() == plan.partition_elems());
  for (bool whole_or_host : {true, false}) {
    StorePlacement q = p;
    (whole_or_host ? q.partitions_grads : q.optimizer_on_host) = !whole_or_host;
    CHECK(throws([&] { PartitionStore(plan, q, default_cpu_backend()); }));
  }
  CHECK(!PartitionStore(plan, plain, default_cpu_backend()).has("grad_sums"));
}

void errors() {
  const LayoutPlan plan = LayoutPlan::make({{30, 0}, {11, 0}}, LayoutOptions{2, 1, 8});
  StorePlacement p;
  CHECK(throws([&] { p.rank = 2; PartitionStore(plan, p, default_cpu_backend()); }));
  p.rank = 0;
  const PartitionStore s(plan, p, default_cpu_backend());
  const Tensor odd = Tensor::zeros({plan.partition_elems() + 1}, DType::kFloat32);
  const Tensor part = Tensor::zeros({plan.partition_elems()}, DType::kFloat32);
  CHECK(throws([&] { s.param_view(odd, 0); }));
  CHECK(throws([&] { s.param_view(part, 0); }));  // a param is in pieces there
  CHECK(throws([&] { s.param_stretches(part, 2); }));
  CHECK(throws([&] { s.bucket_span(part.numel(), int(plan.buckets().size())); }));
  CHECK(throws([&] { s.run_span(part.numel(), int(s.runs().size())); }));
  CHECK(throws([&] { s.shard_span(part.numel(), 0, 0); }));
}

// Stage 2 with the optimizer offloaded, on the checking backend: each
// buffer of the kind its place says, zeroed, and named in a violation.
void on_a_checking_backend() {
  const LayoutPlan plan = LayoutPlan::make({{30, 0}, {11, 0}}, LayoutOptions{2, 4, 16});
  StorePlacement p;
  p.rank = 1;
  p.dtype = p.reduce_dtype = DType::kBFloat16;
  p.partitions_grads = p.optimizer_on_host = true;
  p.state_names = {"exp_avg"};
  CheckingCpuBackend backend(CheckingOptions{20, 0, 300, true});
  PartitionStore store(plan, p, backend, "the flat group of fc.weight");
  store.allocate();
  for (const BufferSpec& b : store.buffers()) {
    const Tensor t = store.buffer(b.kind);
    for (int64_t i = 0; i < int64_t(t.nbytes()); ++i) CHECK(static_cast<const char*>(t.data())[i] == 0);
  }
  // Written on another stream, read by the host with no wait: named.
  Stream& update = backend.create_stream("offload update");
  backend.copy(update, store.buffer("master"), Tensor::zeros({plan.partition_elems()}, DType::kFloat32));
  backend.fill(update, store.buffer("full"), 1.0f);
  for (const auto& [kind, place] : {std::pair<std::string, std::string>{"master", "host pinned"}, {"full", "device"}}) {
    std::string message;
    try {
      backend.declare_access(backend.compute_stream(), Access::read(store.buffer(kind)), "host reads");
    } catch (const StreamOrderError& e) {
      message = e.what();
    }
    const std::string named = "buffer '" + kind + " of the flat group of fc.weight' (" + place + ")";
    if (message.find(named) == std::string::npos) {
      std::fprintf(stderr, "'%s' not in '%s'\n", named.c_str(), message.c_str());
    }
    CHECK(message.find(named) != std::string::npos);
  }
  CHECK(PartitionStore::memory_kind(Where::kHost) == MemoryKind::kHostPinned);
  CHECK(PartitionStore::memory_kind(Where::kDevice) == MemoryKind::kDevice);
}

}  // namespace

int main() {
  sweep();
  placements();
  step_runs();
  zeroing();
  exact_sums();
  errors();
  on_a_checking_backend();
  return zerocore::test::finish("test_store");
}
