// The backend seam and its checking CPU backend. Each kind of missing wait
// the runtime could commit (a gather before compute reads its slot, compute
// before the slot is gathered into again, a reduce before its staging is
// refilled, the update before params go up, a copy before the host reads)
// is played on streams and buffers: without the wait the checker names both
// accesses and the buffer; with it there is no violation and the result
// matches the same computation done directly, on the checking and the plain
// backend alike. Late completion makes a missing wait read wrong data; host
// waits are counted; event waits order transitively; each backend counts
// the bytes of its live buffers by kind and refuses another's streams.
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "flat_run_helpers.h"
#include "zerocore/zerocore.h"

using namespace zerocore;
using namespace zerocore::test;

namespace {

std::mt19937 rng(20);
constexpr int64_t kN = 4099;  // elements of every buffer; odd, so no kernel sees only whole vectors

CheckingOptions quick() { return CheckingOptions{uint64_t(rng()), 0, 300, true}; }

// A backend with the CUDA path's stream layout.
template <class B>
struct Rig {
  B backend;
  Stream& compute;
  Stream& comm;
  Stream& copy;
  Stream& update;
  template <class... Options>
  explicit Rig(Options... options)
      : backend(options...),
        compute(backend.compute_stream()),
        comm(backend.create_stream("comm")),
        copy(backend.create_stream("copy")),
        update(backend.create_stream("update")) {}

  Tensor buffer(const char* name, MemoryKind kind = MemoryKind::kDevice, DType dtype = DType::kFloat32,
                bool zeroed = false) {
    return backend.allocate(kind, size_t(kN) * dtype_size(dtype), name, zeroed)->view(0, dtype, {kN});
  }
  // `stream` goes on only after everything `after` was given so far.
  void order(Stream& stream, Stream& after) { backend.wait(stream, *backend.record(after)); }
};

// The wait a scenario leaves out when `skip` names it.
struct Waits {
  std::string skip;
  bool operator()(const char* name) const { return skip != name; }
};

bool equal(const Tensor& a, const Tensor& b) { return same(a, b); }

// Gathers `source` into `slot` on the comm stream, as the transport does.
template <class B>
void gather(Rig<B>& r, const Tensor& slot, const Tensor& shard) {
  r.backend.enqueue(r.comm, "all_gather", {Access::write(slot), Access::read(shard)},
                    [slot, shard] { std::memcpy(slot.data(), shard.data(), slot.nbytes()); });
}

// Stage 3's gather pool: unit 0 gathered, read by forward, then unit 1
// gathered into the same slot and read. Returns what forward read of unit 1.
template <class B>
Tensor gather_pool(Rig<B>& r, const Waits& waits, Tensor unit0, Tensor unit1) {
  Tensor slot = r.buffer("gather_pool"), shard = r.buffer("param_shard");
  Tensor seen = Tensor::empty({kN}, DType::kFloat32);
  r.backend.copy(r.compute, shard, unit0);
  r.order(r.comm, r.compute);
  gather(r, slot, shard);
  if (waits("gather before compute reads")) r.order(r.compute, r.comm);
  r.backend.declare_access(r.compute, Access::read(slot), "forward of unit 0");
  r.backend.copy(r.compute, shard, unit1);
  if (waits("compute before the slot is reused")) r.order(r.comm, r.compute);
  gather(r, slot, shard);
  r.order(r.compute, r.comm);
  r.backend.copy(r.compute, seen, slot);  // forward of unit 1
  return seen;
}

// Gradient reduction through one staging bucket, twice: grads accumulated
// into staging on compute, reduced into the grad partition on comm.
template <class B>
Tensor reduce_staging(Rig<B>& r, const Waits& waits, Tensor grads0, Tensor grads1) {
  Tensor staging = r.buffer("reduce_staging");
  Tensor partition = r.buffer("grad_partition", MemoryKind::kDevice, DType::kFloat32, true);
  for (const Tensor& grads : {grads0, grads1}) {
    r.backend.fill(r.compute, staging, 0.0f);
    r.backend.accumulate(r.compute, staging, grads);
    r.order(r.comm, r.compute);
    r.backend.enqueue(r.comm, "reduce_scatter", {Access::read(staging), Access::write(partition)},
                      [staging, partition] { accumulate(partition, staging); });
    if (waits("reduce before staging is reused") || &grads == &grads1) r.order(r.compute, r.comm);
  }
  Tensor seen = Tensor::empty({kN}, DType::kFloat32);
  r.backend.copy(r.compute, seen, partition);
  return seen;
}

// The offloaded update: grads down to the host, Adam on the host partition
// on the update stream, the bf16 copy of the new params up to the device.
template <class B>
Tensor update_then_upload(Rig<B>& r, const Waits& waits, const FlatRun& start) {
  Tensor device_grads = r.buffer("device_grads", MemoryKind::kDevice, DType::kBFloat16);
  Tensor device_params = r.buffer("device_params", MemoryKind::kDevice, DType::kBFloat16);
  FlatRun host{0,
               r.buffer("master", MemoryKind::kHostPinned),
               r.buffer("host_grads", MemoryKind::kHostPinned, DType::kBFloat16),
               r.buffer("exp_avg", MemoryKind::kHostPinned),
               r.buffer("exp_avg_sq", MemoryKind::kHostPinned),
               r.buffer("param_copy", MemoryKind::kHostPinned, DType::kBFloat16)};
  r.backend.copy(r.compute, device_grads, start.grad);
  r.backend.copy(r.compute, host.param, start.param);
  r.backend.copy(r.compute, host.state0, start.state0);
  r.backend.copy(r.compute, host.state1, start.state1);
  r.order(r.copy, r.compute);
  r.backend.copy(r.copy, host.grad, device_grads);
  r.order(r.update, r.copy);
  r.backend.adam_update_runs(r.update, {AdamOptions{}}, 3, 0.5, {host}, Tensor());
  if (waits("update before params go up")) r.order(r.copy, r.update);
  r.backend.copy(r.copy, device_params, host.param_copy);
  r.order(r.compute, r.copy);
  return copy_of(device_params);
}

// The host reads what a copy brought down, and the norm from the mailbox.
template <class B>
std::pair<Tensor, double> host_reads(Rig<B>& r, const Waits& waits, Tensor grads) {
  Tensor device_grads = r.buffer("device_grads"), host_grads = r.buffer("host_grads", MemoryKind::kHostPinned);
  Mailbox box(r.backend, 2, "norm_mailbox");
  r.backend.copy(r.compute, device_grads, grads);
  r.order(r.copy, r.compute);
  r.backend.copy(r.copy, host_grads, device_grads);
  r.order(r.comm, r.compute);
  r.backend.sum_of_squares(r.comm, {device_grads}, box, 0, 1);
  if (waits("a copy before the host reads")) {
    r.backend.host_wait(*r.backend.record(r.copy));
  } else {
    r.order(r.compute, r.copy);  // orders the compute stream, not the host (on CUDA, the device's stream)
  }
  r.backend.declare_host_access(Access::read(host_grads), "host reads grads");
  Tensor seen = copy_of(host_grads);
  if (waits("the norm before the host reads")) r.backend.host_wait(*r.backend.record(r.comm));
  const double norm_sq = box.read(0);
  CHECK(box.read(1) == 1.0);
  return {seen, norm_sq};
}

Tensor uniform(int64_t n) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  Tensor t = Tensor::empty({n}, DType::kFloat32);
  for (int64_t i = 0; i < n; ++i) t.data_as<float>()[i] = u(rng);
  return t;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using Checked = Rig<CheckingCpuBackend>;

// Runs `scenario` on a fresh checking backend with the wait `skip` left out
// and checks the checker raises naming both accesses and the buffer.
void expect_named(const std::string& skip, const std::function<void(Checked&, const Waits&)>& scenario,
                  const std::vector<std::string>& parts) {
  Checked r(quick());
  try {
    scenario(r, Waits{skip});
    std::fprintf(stderr, "no violation without the wait '%s'\n", skip.c_str());
    CHECK(false);
  } catch (const StreamOrderError& e) {
    for (const std::string& part : parts) {
      if (!contains(e.what(), part)) std::fprintf(stderr, "'%s' not in: %s\n", part.c_str(), e.what());
      CHECK(contains(e.what(), part));
    }
  }
}

void test_missing_waits_are_named() {
  const std::string all = "bytes [0, " + std::to_string(kN * 4) + ")";
  Tensor a = uniform(kN), b = uniform(kN);
  FlatRun start{0, uniform(kN), random_tensor(rng, kN, DType::kBFloat16), uniform(kN), uniform(kN), Tensor()};
  for (int64_t i = 0; i < kN; ++i) start.state1.data_as<float>()[i] = std::abs(start.state1.data_as<float>()[i]);
  auto pool = [&](Checked& r, const Waits& w) { gather_pool(r, w, a, b); };
  auto reduce = [&](Checked& r, const Waits& w) { reduce_staging(r, w, a, b); };
  auto offload = [&](Checked& r, const Waits& w) { update_then_upload(r, w, start); };
  auto host = [&](Checked& r, const Waits& w) { host_reads(r, w, a); };

  expect_named("gather before compute reads", pool,
               {"buffer 'gather_pool' (device)", "'all_gather' on stream 'comm' writes " + all,
                "'forward of unit 0' on stream 'compute' reads " + all, "make stream 'compute' wait"});
  expect_named("compute before the slot is reused", pool,
               {"buffer 'gather_pool'", "'forward of unit 0' on stream 'compute' reads " + all,
                "'all_gather' on stream 'comm' writes " + all, "make stream 'comm' wait"});
  expect_named("reduce before staging is reused", reduce,
               {"buffer 'reduce_staging'", "'reduce_scatter' on stream 'comm' reads " + all,
                "'fill' on stream 'compute' writes " + all});
  expect_named("update before params go up", offload,
               {"buffer 'param_copy' (host pinned)",
                "'adam_update' on stream 'update' writes bytes [0, " + std::to_string(kN * 2) + ")",
                "'copy' on stream 'copy' reads"});
  expect_named("a copy before the host reads", host,
               {"buffer 'host_grads' (host pinned)", "'copy' on stream 'copy' writes " + all,
                "'host reads grads' on stream 'host' reads " + all, "make the host wait (host_wait"});
  expect_named("the norm before the host reads", host,
               {"buffer 'norm_mailbox' (host pinned)", "'sum_of_squares' on stream 'comm' writes bytes [0, 8)",
                "'host read of mailbox slot 0' on stream 'host' reads bytes [0, 8)"});
}

// With every wait: no violation, and each result as computed directly.
template <class B, class... Options>
void test_ordered_sequences(Options... options) {
  Tensor a = uniform(kN), b = uniform(kN);
  FlatRun start{0, uniform(kN), random_tensor(rng, kN, DType::kBFloat16), uniform(kN), uniform(kN),
                Tensor::empty({kN}, DType::kBFloat16)};
  for (int64_t i = 0; i < kN; ++i) start.state1.data_as<float>()[i] = std::abs(start.state1.data_as<float>()[i]);
  const Waits all{};

  Rig<B> r1(options...);
  CHECK(equal(gather_pool(r1, all, a, b), b));

  Rig<B> r2(options...);
  Tensor sum = copy_of(a);
  for (int64_t i = 0; i < kN; ++i) sum.data_as<float>()[i] = (0.0f + a.data_as<float>()[i]) + b.data_as<float>()[i];
  CHECK(equal(reduce_staging(r2, all, a, b), sum));

  Rig<B> r3(options...);
  FlatRun direct = copy_of(start);
  adam_update_runs({AdamOptions{}}, 3, 0.5, {direct});
  CHECK(equal(update_then_upload(r3, all, start), direct.param_copy));

  Rig<B> r4(options...);
  double norm_sq = 0.0;
  for (int64_t i = 0; i < kN; ++i) norm_sq += double(a.data_as<float>()[i]) * double(a.data_as<float>()[i]);
  auto [seen, got] = host_reads(r4, all, a);
  CHECK(equal(seen, a));
  CHECK(std::abs(got - norm_sq) <= 1e-12 * norm_sq);
  if constexpr (std::is_same_v<B, CheckingCpuBackend>) {
    for (Rig<B>* r : {&r1, &r2, &r3, &r4}) CHECK(r->backend.violations().empty());
  }
}

// A non-finite grad clears the mailbox's finiteness flag.
void test_finite_flag() {
  Checked r(quick());
  Tensor grads = r.buffer("grads");
  Tensor values = uniform(kN);
  values.data_as<float>()[kN / 2] = INFINITY;
  Mailbox box(r.backend, 2, "norm_mailbox");
  r.backend.copy(r.compute, grads, values);
  r.order(r.comm, r.compute);
  r.backend.sum_of_squares(r.comm, {grads}, box, 0, 1);
  r.backend.host_wait(*r.backend.record(r.comm));
  CHECK(box.read(1) == 0.0);
  CHECK(std::isinf(box.read(0)));
}

// Work on a non-compute stream completes late, so reading without the wait
// sees what was there before: NaN, in a buffer allocated without zeroing
// or poisoned on release.
void test_late_completion_gives_wrong_results() {
  CheckingOptions late{uint64_t(rng()), 100000, 100000, false};  // 0.1 s, far longer than the host's next call
  Checked r(late);
  Tensor produced = r.buffer("produced"), seen = Tensor::empty({kN}, DType::kFloat32), values = uniform(kN);
  r.backend.copy(r.comm, produced, values);
  r.backend.copy(r.compute, seen, produced);  // no wait: a violation, and stale data
  CHECK(std::isnan(seen.data_as<float>()[0]) && std::isnan(seen.data_as<float>()[kN - 1]));
  CHECK(r.backend.violations().size() == 1);
  bool raised = false;
  try {
    r.backend.check();
  } catch (const StreamOrderError& e) {
    raised = contains(e.what(), "1 stream-order violation") && contains(e.what(), "buffer 'produced'");
  }
  CHECK(raised);

  r.order(r.compute, r.comm);
  r.backend.copy(r.compute, seen, produced);
  CHECK(equal(seen, values));
  r.order(r.comm, r.compute);
  r.backend.poison(r.comm, produced);  // released: poisoned in comm's order
  r.order(r.compute, r.comm);
  r.backend.copy(r.compute, seen, produced);
  CHECK(std::isnan(seen.data_as<float>()[0]) && std::isnan(seen.data_as<float>()[kN - 1]));
  CHECK(r.backend.violations().size() == 1);
}

void test_host_waits_are_counted() {
  Checked r(quick());
  Tensor t = r.buffer("t");
  r.backend.fill(r.comm, t, 1.0f);
  auto event = r.backend.record(r.comm);
  r.backend.wait(r.copy, *event);  // a stream's wait does not block the host
  r.backend.wait(r.compute, *event);
  r.backend.query(*event);
  CHECK(r.backend.host_waits() == 0);
  r.backend.host_wait(*event);
  r.backend.host_wait(*r.backend.record(r.copy));
  CHECK(r.backend.host_waits() == 2);
  CHECK(r.backend.take_host_waits() == 2);
  CHECK(r.backend.host_waits() == 0);
}

// A watched host wait calls the watch each slice and ends with what it
// throws; the work goes on, and a later wait sees it done. The compute
// stream's wait (the caller's, on the CPU) is watched too.
void test_watched_host_waits_end_with_what_the_watch_throws() {
  CpuBackend backend;
  Stream& held = backend.create_stream("held");
  auto gate = std::make_shared<Event>();
  backend.enqueue(held, "held work", {}, [gate] { gate->wait(); });
  auto event = backend.record(held);
  std::vector<double> calls;
  backend.watch_host_waits(0.02, [&calls](double waited) {
    calls.push_back(waited);
    if (calls.size() % 2 == 0) throw RankDisagreement("apart after " + std::to_string(calls.size()) + " slices");
  });
  for (bool host : {true, false}) {
    bool raised = false;
    try {
      host ? backend.host_wait(*event) : backend.wait(backend.compute_stream(), *event);
    } catch (const RankDisagreement& e) {
      raised = contains(e.what(), "apart after");
    }
    CHECK(raised);
  }
  CHECK(calls.size() == 4 && calls[1] > calls[0]);
  gate->set();
  backend.host_wait(*event);  // done now: no slice to wait
  CHECK(calls.size() == 4);
  backend.watch_host_waits(0.02, nullptr);
  auto gate2 = std::make_shared<Event>();
  backend.enqueue(held, "held work", {}, [gate2] { gate2->wait(); });
  std::thread opener([gate2] {
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    gate2->set();
  });
  backend.host_wait(*backend.record(held));  // unwatched: whole
  opener.join();
  CHECK(calls.size() == 4);
}

// B writes; A waits for B; C waits for A: C is ordered after B's write.
// C waiting for an event A recorded before its wait for B is not.
void test_clocks_are_transitive() {
  for (bool through_a : {true, false}) {
    CheckingCpuBackend backend(CheckingOptions{uint64_t(rng()), 0, 2000, true});
    Stream &a = backend.create_stream("A"), &b = backend.create_stream("B"), &c = backend.create_stream("C");
    Tensor values = uniform(kN), seen = Tensor::empty({kN}, DType::kFloat32);
    Tensor data = backend.allocate(MemoryKind::kDevice, size_t(kN) * 4, "data")->view(0, DType::kFloat32, {kN});
    auto a_before = backend.record(a);
    backend.copy(b, data, values);
    backend.wait(a, *backend.record(b));
    auto a_after = backend.record(a);
    try {
      backend.wait(c, through_a ? *a_after : *a_before);
      backend.copy(c, seen, data);
      backend.host_wait(*backend.record(c));
      CHECK(through_a);
      CHECK(equal(seen, values));
    } catch (const StreamOrderError& e) {
      CHECK(!through_a);
      CHECK(contains(e.what(), "'copy' on stream 'B' writes") && contains(e.what(), "'copy' on stream 'C' reads"));
    }
  }
}

// Reads on several streams need no order among themselves; one stream's
// own accesses are ordered by the stream; a caller's memory is not tracked.
void test_what_needs_no_wait() {
  Checked r(quick());
  Tensor shared = r.buffer("shared", MemoryKind::kDevice, DType::kFloat32, true);
  Tensor mine = Tensor::empty({kN}, DType::kFloat32);
  Tensor out_comm = r.buffer("out_comm"), out_copy = r.buffer("out_copy");
  r.backend.copy(r.comm, out_comm, shared);
  r.backend.copy(r.copy, out_copy, shared);
  r.backend.fill(r.comm, out_comm, 2.0f);
  r.backend.copy(r.comm, mine, out_comm);
  r.backend.copy(r.copy, mine, out_copy);  // both write `mine`, a caller's tensor: not tracked
  CHECK(r.backend.violations().empty());
}

// A slot pool allocating through the checking backend: its slots, planned
// or beyond the plan, are checked buffers, and a released slot is poisoned
// in the order of its last use.
void test_slot_pool_on_checking_backend() {
  Checked r(CheckingOptions{uint64_t(rng()), 0, 300, false});
  SlotPool pool(DType::kFloat32, kN, 1, r.backend, MemoryKind::kDevice, "gather pool");
  const int planned = pool.acquire(), extra = pool.acquire();
  auto slot_of = [&](int slot) { return pool.slot(slot).slice(0, kN); };  // slots are rounded up to cache lines
  Tensor values = uniform(kN), seen = Tensor::empty({kN}, DType::kFloat32);
  for (int slot : {planned, extra}) {
    r.backend.copy(r.comm, slot_of(slot), values);
    r.backend.declare_access(r.compute, Access::read(slot_of(slot)), "forward");  // no wait
  }
  const std::vector<std::string> found = r.backend.violations();
  CHECK(found.size() == 2);
  CHECK(contains(found[0], "buffer 'gather pool' (device)"));
  CHECK(contains(found[1], "buffer 'gather pool (beyond plan)' (device)"));

  r.order(r.compute, r.comm);
  r.backend.copy(r.compute, seen, slot_of(planned));
  CHECK(equal(seen, values));
  r.order(r.comm, r.compute);
  pool.release(planned, r.comm);
  r.order(r.compute, r.comm);
  r.backend.copy(r.compute, seen, slot_of(planned));
  CHECK(std::isnan(seen.data_as<float>()[0]) && std::isnan(seen.data_as<float>()[kN - 1]));
  CHECK(r.backend.violations().size() == 2);
  CHECK(pool.free_slots() == 1);
}

// What follows an event's set (Event::on_set, how the CUDA backend records
// a collective's event on its issuing thread): run by the thread that sets
// it, after the event reads as set and before set returns, once; at once on
// the caller's thread when the event is set already; after a failure too.
void test_event_runs_what_follows_its_set() {
  Event event;
  std::thread::id ran_on;
  bool saw_set = false;
  int runs = 0;
  event.on_set([&] {
    ran_on = std::this_thread::get_id();
    saw_set = event.ready();
    ++runs;
  });
  CHECK(runs == 0);
  std::thread setter([&] {
    event.set();
    CHECK(runs == 1);  // before set returned
  });
  const std::thread::id setter_id = setter.get_id();
  setter.join();
  CHECK(runs == 1 && saw_set && ran_on == setter_id);
  event.on_set([&] {
    ran_on = std::this_thread::get_id();
    ++runs;
  });
  CHECK(runs == 2 && ran_on == std::this_thread::get_id());

  Event failed;
  bool ran_after_failure = false;
  failed.on_set([&] { ran_after_failure = true; });
  failed.set(std::make_exception_ptr(std::runtime_error("collective failed")));
  CHECK(ran_after_failure);
  std::string message;
  try {
    failed.wait();
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  CHECK(message == "collective failed");
}

// allocated_bytes: each kind counts the live buffers of that kind, a
// buffer living while any view of it does, and a buffer may outlive its
// backend.
template <class B, class... Options>
void test_allocated_bytes_count_live_buffers(Options... options) {
  auto backend = std::make_unique<B>(options...);
  auto bytes = [&] {
    return std::vector<size_t>{backend->allocated_bytes(MemoryKind::kHostPageable),
                               backend->allocated_bytes(MemoryKind::kHostPinned),
                               backend->allocated_bytes(MemoryKind::kDevice)};
  };
  CHECK((bytes() == std::vector<size_t>{0, 0, 0}));
  auto device = backend->allocate(MemoryKind::kDevice, 4096, "device");
  auto pinned = backend->allocate(MemoryKind::kHostPinned, 1000, "pinned", true);
  Tensor view = backend->allocate(MemoryKind::kHostPageable, 64, "pageable")->view(8, DType::kFloat32, {4});
  auto second = backend->allocate(MemoryKind::kDevice, 8, "second device");
  CHECK((bytes() == std::vector<size_t>{64, 1000, 4104}));
  second.reset();
  CHECK((bytes() == std::vector<size_t>{64, 1000, 4096}));
  Tensor kept = device->view(0, DType::kFloat32, {1024});
  device.reset();
  CHECK((bytes() == std::vector<size_t>{64, 1000, 4096}));  // its view keeps it
  kept = Tensor();
  pinned.reset();
  CHECK((bytes() == std::vector<size_t>{64, 0, 0}));
  backend.reset();  // the view outlives its backend
  view.data_as<float>()[3] = 1.0f;
  view = Tensor();
}

// A stream of another backend is refused, of the same kind too (the
// backends' OwnedStreams): the error names the stream.
template <class B, class... Options>
void test_another_backends_stream_is_refused(Options... options) {
  B mine(options...), theirs(options...);
  for (Stream* s : {&theirs.compute_stream(), &theirs.create_stream("their comm")}) {
    std::string message;
    try {
      mine.record(*s);
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
    CHECK(message.find("stream '" + s->name() + "' belongs to another backend") != std::string::npos);
  }
  mine.host_wait(*mine.record(mine.create_stream("comm")));  // its own
}

}  // namespace

// A kernel runs on the side its memory is on (kernel_on_host): the checking
// backend refuses one that mixes host and device memory, as CUDA must, and
// takes memory that is no backend buffer (torch's) for device memory.
void test_kernels_run_on_one_side() {
  Checked r(quick());
  Tensor device = r.buffer("device", MemoryKind::kDevice, DType::kFloat32, true);
  Tensor pinned = r.buffer("pinned", MemoryKind::kHostPinned, DType::kFloat32, true);
  Tensor pageable = r.buffer("pageable", MemoryKind::kHostPageable, DType::kFloat32, true);
  Tensor torchs = uniform(kN);
  r.backend.accumulate(r.compute, pinned, pageable);  // host and host
  r.backend.accumulate(r.compute, device, torchs);    // device and device
  for (const auto& [dst, src] : {std::pair<Tensor, Tensor>{pinned, device}, {pageable, torchs}, {device, pinned}}) {
    std::string message;
    try {
      r.backend.accumulate(r.compute, dst, src);
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
    const bool host_dst = dst.data() != device.data();
    const std::string named = host_dst ? "dst is host memory and src device memory" : "src is host memory and dst device memory";
    if (!contains(message, named)) std::fprintf(stderr, "'%s' not in '%s'\n", named.c_str(), message.c_str());
    CHECK(contains(message, named) && contains(message, "accumulate"));
  }
  CHECK(r.backend.violations().empty());
}

int main() {
  test_kernels_run_on_one_side();
  test_missing_waits_are_named();
  test_ordered_sequences<CheckingCpuBackend>(quick());
  test_ordered_sequences<CpuBackend>();
  test_finite_flag();
  test_late_completion_gives_wrong_results();
  test_host_waits_are_counted();
  test_watched_host_waits_end_with_what_the_watch_throws();
  test_clocks_are_transitive();
  test_what_needs_no_wait();
  test_slot_pool_on_checking_backend();
  test_event_runs_what_follows_its_set();
  test_allocated_bytes_count_live_buffers<CpuBackend>();
  test_allocated_bytes_count_live_buffers<CheckingCpuBackend>(quick());
  test_another_backends_stream_is_refused<CpuBackend>();
  test_another_backends_stream_is_refused<CheckingCpuBackend>(quick());
  return finish("test_backend");
}
