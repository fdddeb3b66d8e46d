// The offloaded step against the same work done in plain calls: grads
// copied down, one multi-run update, params copied up, bit for bit; copies
// held back until asked for; grads copied down only once the update that
// reads them is done; swapped grad buffers instead of copies; bad input
// refused before anything is queued. On the checking backend: a step with
// every wait has no violation and the plain backend's bits, and each wait
// a caller of the pipeline could leave out (the host reading grads before
// their copy, a gather reading params before they are up or before the
// update that writes them, the update reading grads another stream copies
// down) is named with both accesses and the buffer.
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "flat_run_helpers.h"
#include "zerocore/zerocore.h"

using namespace zerocore;
using namespace zerocore::test;

namespace {

std::mt19937 rng(5);

Tensor zeros(int64_t n, DType dtype) {
  Tensor t = Tensor::empty({n}, dtype);
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

// A buffer of `backend` holding `values`, so the checking backend tracks it.
Tensor placed(Backend& backend, MemoryKind kind, const char* name, const Tensor& values) {
  Tensor t = backend.allocate(kind, values.nbytes(), name)->view(0, values.dtype(), {values.numel()});
  std::memcpy(t.data(), values.data(), values.nbytes());
  return t;
}

// A partition in three buckets: on the "device" bf16 grads and params, on
// the host an fp32 master, moments, bf16 grads and the bf16 copy of the
// new params. Large enough that an update outlasts queueing the next copy.
struct Partition {
  std::vector<Tensor> device_grads, device_params;
  std::vector<OffloadBucket> buckets;

  Partition() {
    for (int64_t n : {70000, 4099, 300000}) {
      Tensor grad = random_tensor(rng, n, DType::kBFloat16), param = zeros(n, DType::kBFloat16);
      FlatRun run{0, random_tensor(rng, n, DType::kFloat32), zeros(n, DType::kBFloat16), zeros(n, DType::kFloat32),
                  zeros(n, DType::kFloat32), zeros(n, DType::kBFloat16)};
      add(grad, param, run);
    }
  }
  // `values`' contents in buffers of `backend`: device and pinned host memory.
  Partition(const Partition& values, Backend& backend) {
    for (size_t i = 0; i < values.buckets.size(); ++i) {
      const FlatRun& r = values.buckets[i].runs[0];
      const MemoryKind host = MemoryKind::kHostPinned;
      add(placed(backend, MemoryKind::kDevice, "device_grads", values.device_grads[i]),
          placed(backend, MemoryKind::kDevice, "device_params", values.device_params[i]),
          FlatRun{0, placed(backend, host, "master", r.param), placed(backend, host, "host_grads", r.grad),
                  placed(backend, host, "exp_avg", r.state0), placed(backend, host, "exp_avg_sq", r.state1),
                  placed(backend, host, "param_copy", r.param_copy)});
    }
  }
  void add(const Tensor& grad, const Tensor& param, const FlatRun& run) {
    device_grads.push_back(grad);
    device_params.push_back(param);
    buckets.push_back(OffloadBucket{{run}, {TensorCopy{grad, run.grad}}, {TensorCopy{run.param_copy, param}}, {}});
  }
  // Independent copies of the host runs, for the plain calls.
  std::vector<FlatRun> runs_copy() const {
    std::vector<FlatRun> out;
    for (const OffloadBucket& b : buckets) {
      out.push_back(copy_of(b.runs[0]));
      out.back().grad = copy_of(b.runs[0].grad);  // copy_of shares a run's grad
    }
    return out;
  }
};

AdamOptions adam_options() {
  AdamOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1;
  return o;
}

void test_step_equals_plain_calls() {
  Partition part;
  std::vector<FlatRun> plain = part.runs_copy();
  OffloadOptimizer offload(part.buckets, default_cpu_backend());
  for (int64_t step = 1; step <= 3; ++step) {
    offload.copy_grads();
    offload.wait();
    std::vector<Tensor> grads;
    for (size_t i = 0; i < plain.size(); ++i) {
      std::memcpy(plain[i].grad.data(), part.device_grads[i].data(), plain[i].grad.nbytes());
      grads.push_back(plain[i].grad);
    }
    CHECK(offload.grad_sum_of_squares() == sum_of_squares(grads));
    offload.adam({adam_options()}, step, 0.5, /*copy_params=*/true);
    adam_update_runs({adam_options()}, step, 0.5, plain);
    offload.wait();
    CHECK(!offload.busy());
  }
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(same(part.buckets[i].runs[0], plain[i]));
    CHECK(same(part.device_params[i], plain[i].param_copy));
  }
}

void test_held_copies_wait_for_copy_params() {
  Partition part;
  OffloadOptimizer offload(part.buckets, default_cpu_backend());
  offload.copy_grads();
  offload.sgd({SgdOptions{}}, 1, 1.0, /*copy_params=*/false);
  offload.wait();
  const Tensor untouched = zeros(part.device_params[0].numel(), DType::kBFloat16);
  CHECK(same(part.device_params[0], untouched));
  offload.copy_params();
  offload.wait();
  for (size_t i = 0; i < part.buckets.size(); ++i) CHECK(same(part.device_params[i], part.buckets[i].runs[0].param_copy));
}

void test_grads_go_down_after_the_update_reading_them() {
  Partition part;
  std::vector<FlatRun> plain = part.runs_copy();
  OffloadOptimizer offload(part.buckets, default_cpu_backend());
  offload.copy_grads();
  offload.wait();
  for (size_t i = 0; i < plain.size(); ++i) {
    std::memcpy(plain[i].grad.data(), part.device_grads[i].data(), plain[i].grad.nbytes());
  }
  offload.adam({adam_options()}, 1, 1.0, false);
  // The next step's grads, copied down while the update may still run.
  std::vector<Tensor> next;
  for (const Tensor& g : part.device_grads) {
    Tensor n = random_tensor(rng, g.numel(), DType::kBFloat16);
    std::memcpy(g.data(), n.data(), g.nbytes());
    next.push_back(n);
  }
  offload.copy_grads();
  offload.wait();
  adam_update_runs({adam_options()}, 1, 1.0, plain);
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(same(part.buckets[i].runs[0].param, plain[i].param));  // updated with the old grads
    CHECK(same(part.buckets[i].runs[0].grad, next[i]));
  }
}

// The delayed update's double buffer: reduction writes the spare grads
// while the update reads the others; swap_grads trades them with no copy.
void test_swapped_grads_feed_the_update_without_a_copy() {
  Partition part;
  std::vector<Tensor> reading, filling;  // per bucket: the grads an update reads, those backward fills
  for (OffloadBucket& b : part.buckets) {
    b.grads_down.clear();
    b.spare_grads = {zeros(b.runs[0].grad.numel(), DType::kBFloat16)};
    reading.push_back(b.runs[0].grad);
    filling.push_back(b.spare_grads[0]);
  }
  std::vector<FlatRun> plain = part.runs_copy();
  OffloadOptimizer offload(part.buckets, default_cpu_backend());
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<Tensor> grads;  // this step's backward
    for (size_t i = 0; i < plain.size(); ++i) {
      const Tensor g = random_tensor(rng, filling[i].numel(), DType::kBFloat16);
      std::memcpy(filling[i].data(), g.data(), g.nbytes());
      std::memcpy(plain[i].grad.data(), g.data(), g.nbytes());
      grads.push_back(g);
    }
    offload.wait();
    offload.swap_grads();
    std::swap(reading, filling);
    CHECK(offload.grad_sum_of_squares() == sum_of_squares(grads));
    offload.adam({adam_options()}, step, 0.5, /*copy_params=*/false);
    adam_update_runs({adam_options()}, step, 0.5, plain);
    for (const Tensor& f : filling) std::memset(f.data(), 0xff, f.nbytes());  // the next backward, meanwhile: NaNs
  }
  offload.wait();
  for (size_t i = 0; i < plain.size(); ++i) CHECK(same(part.buckets[i].runs[0].param, plain[i].param));
  bool threw = false;
  try {
    std::vector<OffloadBucket> bad = part.buckets;
    bad[0].spare_grads[0] = zeros(3, DType::kBFloat16);
    OffloadOptimizer refused(bad, default_cpu_backend());
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
}

void test_bad_input_is_refused_up_front() {
  Partition part;
  bool threw = false;
  try {
    std::vector<OffloadBucket> bad = part.buckets;
    bad[1].params_up[0].dst = zeros(5, DType::kBFloat16);
    OffloadOptimizer offload(bad, default_cpu_backend());
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
  OffloadOptimizer offload(part.buckets, default_cpu_backend());
  const std::vector<FlatRun> before = part.runs_copy();
  AdamOptions negative = adam_options();
  negative.lr = -1;
  threw = false;
  try {
    offload.adam({negative}, 1, 1.0, true);
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    offload.adam({}, 1, 1.0, true);  // the runs are in group 0, and no group was given
  } catch (const InvalidArgument&) {
    threw = true;
  }
  CHECK(threw);
  offload.wait();
  for (size_t i = 0; i < before.size(); ++i) CHECK(same(part.buckets[i].runs[0], before[i]));
}

// The host update refuses device memory where it reads or writes.
void test_device_tensors_are_refused() {
  Partition part;
  const Tensor on_gpu(part.buckets[2].runs[0].grad.data(), DType::kBFloat16, Device{DeviceType::kCUDA, 1},
                      {part.buckets[2].runs[0].grad.numel()}, nullptr);
  for (int which = 0; which < 2; ++which) {
    std::vector<OffloadBucket> bad = part.buckets;
    (which == 0 ? bad[2].runs[0].grad : bad[2].params_up[0].src) = on_gpu;
    std::string message;
    try {
      OffloadOptimizer offload(bad, default_cpu_backend());
    } catch (const TypeMismatch& e) {
      message = e.what();
    }
    const std::string named =
        which == 0 ? "bucket 2's run 0 grad is on cuda:1" : "bucket 2's param copy's source is on cuda:1";
    if (message.find(named) == std::string::npos) {
      std::fprintf(stderr, "not named '%s': '%s'\n", named.c_str(), message.c_str());
    }
    CHECK(message.find("OffloadOptimizer") != std::string::npos && message.find(named) != std::string::npos);
  }
}

// The waits a caller of the pipeline makes; `skip` names one left out.
struct Waits {
  std::string skip;
  bool operator()(const char* name) const { return skip != name; }
};

// What two steps leave: the norm the host read, the params gathered after
// each step, the host runs.
struct Outcome {
  double norm = 0;
  std::vector<Tensor> gathered_up, gathered_host;
  std::vector<FlatRun> runs;
};

// Two steps on `backend` over copies of `values`. Step 1 as stage 1: the
// pipeline copies the grads down, the host reads their norm, the update
// copies the params up, and a gather on the comm stream reads them. Step 2
// as stage 3 with offload_params and a delayed update: another stream (the
// reducer's) copies new grads down, the update leaves the params on the
// host, and a gather reads the host copy.
template <class B>
Outcome two_steps(B& backend, const Waits& waits, const Partition& values, const std::vector<Tensor>& next_grads) {
  Stream& compute = backend.compute_stream();
  Stream& comm = backend.create_stream("comm");
  Stream& grad_copy = backend.create_stream("grad copy");
  auto order = [&](Stream& stream, Stream& after) { backend.wait(stream, *backend.record(after)); };
  auto gather = [&](const std::vector<Tensor>& sources) {
    std::vector<Tensor> out;
    for (const Tensor& src : sources) {
      Tensor dst = Tensor::empty({src.numel()}, src.dtype());
      backend.enqueue(comm, "all_gather", {Access::read(src)},
                      [dst, src] { std::memcpy(dst.data(), src.data(), src.nbytes()); });
      out.push_back(dst);
    }
    backend.host_wait(*backend.record(comm));
    return out;
  };
  Partition part(values, backend);
  Stream& offload_copy = backend.create_stream("offload copy");
  OffloadOptimizer offload(part.buckets, backend, offload_copy, backend.create_stream("offload update"));
  Outcome out;

  offload.copy_grads();
  // Only the grads down: the host wait in offload.wait() below would cover it.
  if (waits("a copy before the host reads")) backend.host_wait(*backend.record(offload_copy));
  out.norm = offload.grad_sum_of_squares();
  offload.adam({adam_options()}, 1, 0.5, /*copy_params=*/true);  // bucket by bucket behind its grads
  if (waits("params up before the gather")) {
    offload.wait();
    order(comm, compute);
  }
  out.gathered_up = gather(part.device_params);

  order(grad_copy, compute);  // the host grads' last reader (the update) was waited for
  for (size_t i = 0; i < next_grads.size(); ++i) backend.copy(grad_copy, part.buckets[i].runs[0].grad, next_grads[i]);
  if (waits("grads down before the update")) order(compute, grad_copy);
  offload.adam({adam_options()}, 2, 0.5, /*copy_params=*/false);
  if (waits("the update before the gather")) {
    offload.wait();
    order(comm, compute);
  }
  std::vector<Tensor> host_params;
  for (const OffloadBucket& b : part.buckets) host_params.push_back(b.runs[0].param_copy);
  out.gathered_host = gather(host_params);
  offload.wait();
  for (const OffloadBucket& b : part.buckets) out.runs.push_back(copy_of(b.runs[0]));
  return out;
}

bool same_outcome(const Outcome& a, const Outcome& b) {
  bool ok = a.norm == b.norm && a.runs.size() == b.runs.size();
  for (size_t i = 0; ok && i < a.runs.size(); ++i) {
    ok = same(a.gathered_up[i], b.gathered_up[i]) && same(a.gathered_host[i], b.gathered_host[i]) &&
         same(a.runs[i], b.runs[i]);
  }
  return ok;
}

void test_on_the_checking_backend() {
  const Partition values;
  std::vector<Tensor> next;
  for (const Tensor& g : values.device_grads) next.push_back(random_tensor(rng, g.numel(), DType::kBFloat16));

  // The same two steps in plain calls.
  Outcome direct;
  std::vector<FlatRun> plain = values.runs_copy();
  std::vector<Tensor> grads;
  for (size_t i = 0; i < plain.size(); ++i) {
    std::memcpy(plain[i].grad.data(), values.device_grads[i].data(), plain[i].grad.nbytes());
    grads.push_back(plain[i].grad);
  }
  direct.norm = sum_of_squares(grads);
  adam_update_runs({adam_options()}, 1, 0.5, plain);
  for (const FlatRun& r : plain) direct.gathered_up.push_back(copy_of(r.param_copy));
  for (size_t i = 0; i < plain.size(); ++i) std::memcpy(plain[i].grad.data(), next[i].data(), next[i].nbytes());
  adam_update_runs({adam_options()}, 2, 0.5, plain);
  for (const FlatRun& r : plain) direct.gathered_host.push_back(copy_of(r.param_copy));
  direct.runs = plain;

  CheckingCpuBackend checking(CheckingOptions{uint64_t(rng()), 0, 300, true});
  CHECK(same_outcome(two_steps(checking, Waits{}, values, next), direct));
  CHECK(checking.violations().empty());
  CpuBackend cpu;
  CHECK(same_outcome(two_steps(cpu, Waits{}, values, next), direct));

  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"a copy before the host reads",
       {"buffer 'host_grads' (host pinned)", "'copy' on stream 'offload copy' writes",
        "'host reads grads' on stream 'host' reads", "host_wait"}},
      {"params up before the gather",
       {"buffer 'device_params' (device)", "'copy' on stream 'offload copy' writes",
        "'all_gather' on stream 'comm' reads", "make stream 'comm' wait"}},
      {"grads down before the update",
       {"buffer 'host_grads' (host pinned)", "'copy' on stream 'grad copy' writes",
        "'adam_update' on stream 'offload update' reads"}},
      {"the update before the gather",
       {"buffer 'param_copy' (host pinned)", "'adam_update' on stream 'offload update' writes",
        "'all_gather' on stream 'comm' reads"}},
  };
  for (const auto& [skip, parts] : cases) {
    CheckingCpuBackend backend(CheckingOptions{uint64_t(rng()), 0, 300, true});
    std::string message;
    try {
      two_steps(backend, Waits{skip}, values, next);
    } catch (const StreamOrderError& e) {
      message = e.what();
    }
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        std::fprintf(stderr, "without '%s': '%s' not in '%s'\n", skip.c_str(), part.c_str(), message.c_str());
        CHECK(false);
      }
    }
  }
}

}  // namespace

int main() {
  test_step_equals_plain_calls();
  test_held_copies_wait_for_copy_params();
  test_grads_go_down_after_the_update_reading_them();
  test_swapped_grads_feed_the_update_without_a_copy();
  test_bad_input_is_refused_up_front();
  test_device_tensors_are_refused();
  test_on_the_checking_backend();
  return finish("test_offload");
}
