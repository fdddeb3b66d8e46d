#include "zerocore/backend/cpu_backend.h"

#include <cstring>
#include <utility>

#include "zerocore/runtime/arena.h"
#include "zerocore/kernels/cpu_accumulate.h"
#include "zerocore/kernels/cpu_exact_grid.h"
#include "zerocore/kernels/cpu_fill.h"
#include "zerocore/kernels/cpu_optim.h"
#include "zerocore/kernels/cpu_reduce.h"
#include "zerocore/error.h"
#include "zerocore/runtime/work_queue.h"

namespace zerocore {

struct CpuBackend::CpuStream : Stream {
  CpuStream(std::string name, int index, StreamPlane plane) : Stream(std::move(name), plane), index(index) {}
  const int index;
  // None for the compute stream (its work runs inline) and for another
  // stream until its first work.
  std::unique_ptr<WorkQueue> queue;
  std::shared_ptr<Event> last;  // completes after everything queued so far
  WorkQueue& work_queue() {
    if (!queue) queue = std::make_unique<WorkQueue>();
    return *queue;
  }
};

namespace {
// What every compute-stream record returns: its work ran before the record.
const std::shared_ptr<Event>& completed() {
  static const std::shared_ptr<Event> done = [] {
    auto e = std::make_shared<Event>();
    e->set();
    return e;
  }();
  return done;
}

const CpuEvent& cpu_event(const StreamEvent& event) {
  const auto* e = dynamic_cast<const CpuEvent*>(&event);
  if (!e) throw InvalidArgument("an event recorded by another kind of backend was given to a CPU backend");
  return *e;
}
}  // namespace

CpuBackend::CpuBackend() : compute_(&streams_.add("compute", StreamPlane::kDevice)) {}

CpuBackend::~CpuBackend() = default;  // each WorkQueue runs what it was given, then joins

std::shared_ptr<Buffer> CpuBackend::allocate(MemoryKind kind, size_t bytes, const std::string& name, bool zeroed) {
  auto arena = HostArena::create(bytes, zeroed);
  return counted_buffer(kind, Device{}, name, arena->data(), bytes, arena);
}

Stream& CpuBackend::compute_stream() { return *compute_; }

Stream& CpuBackend::create_stream(const std::string& name, StreamPlane plane) { return streams_.add(name, plane); }

int CpuBackend::index_of(const Stream& stream) const { return streams_.of(stream).index; }

std::shared_ptr<CpuEvent> CpuBackend::record_with(Stream& stream, std::vector<uint64_t> clock) {
  CpuStream& s = streams_.of(stream);
  return std::make_shared<CpuEvent>(s.queue && s.last ? s.last : completed(), std::move(clock));
}

std::shared_ptr<StreamEvent> CpuBackend::record(Stream& stream) { return record_with(stream, {}); }

void CpuBackend::wait(Stream& stream, const StreamEvent& event) {
  const std::shared_ptr<Event>& done = cpu_event(event).done();
  if (done->ready()) return;
  CpuStream& s = streams_.of(stream);
  if (s.index == kCompute) {
    CpuBackend::host_wait(event);  // the compute stream is the caller: it waits where it stands (uncounted)
    return;
  }
  s.last = s.work_queue().enqueue([done] { done->wait(); });
}

void CpuBackend::host_wait(const StreamEvent& event) {
  const std::shared_ptr<Event>& done = cpu_event(event).done();
  watched_wait([&done](double seconds) {
    if (seconds >= 0) return done->wait_for(seconds);
    done->wait();
    return true;
  });
}

std::shared_ptr<StreamEvent> CpuBackend::record_done(Stream& stream, std::shared_ptr<Event> done) {
  streams_.of(stream);  // the stream must be this backend's
  return std::make_shared<CpuEvent>(std::move(done), std::vector<uint64_t>{});
}

std::shared_ptr<Event> CpuBackend::host_tail(Stream& stream) {
  const CpuStream& s = streams_.of(stream);
  return s.last && !s.last->ready() ? s.last : nullptr;  // the compute stream's work ran inline
}

bool CpuBackend::query(const StreamEvent& event) { return cpu_event(event).done()->ready(); }

void CpuBackend::enqueue(Stream& stream, const std::string&, const std::vector<Access>&, std::function<void()> body) {
  CpuStream& s = streams_.of(stream);
  if (s.index == kCompute) {
    body();
    return;
  }
  s.last = s.work_queue().enqueue(std::move(body));
}

void CpuBackend::copy(Stream& stream, const Tensor& dst, const Tensor& src) {
  if (dst.device().type != DeviceType::kCPU || src.device().type != DeviceType::kCPU) {
    throw TypeMismatch("copy: a CPU backend copies host tensors only; this one was given a CUDA tensor");
  }
  if (dst.dtype() != src.dtype() || dst.numel() != src.numel()) {
    throw InvalidArgument(std::string("copy: ") + std::to_string(src.numel()) + " " + dtype_name(src.dtype()) +
                          " elements into " + std::to_string(dst.numel()) + " " + dtype_name(dst.dtype()) +
                          " (a copy does not convert; use accumulate into zeros to cast)");
  }
  enqueue(stream, "copy", {Access::write(dst), Access::read(src)},
          [dst, src] { std::memcpy(dst.data(), src.data(), dst.nbytes()); });
}

void CpuBackend::fill(Stream& stream, const Tensor& dst, float value) {
  check_kernel_memory("fill", {{"dst", &dst}});
  enqueue(stream, "fill", {Access::write(dst)}, [dst, value] { zerocore::fill(dst, value); });
}

void CpuBackend::accumulate(Stream& stream, const Tensor& dst, const Tensor& src) {
  check_kernel_memory("accumulate", {{"dst", &dst}, {"src", &src}});
  enqueue(stream, "accumulate", {Access::write(dst), Access::read(src)},
          [dst, src] { zerocore::accumulate(dst, src); });
}

void CpuBackend::accumulate_on_grid(Stream& stream, const Tensor& dst, const Tensor& src, int exponent,
                                    const Tensor& largest) {
  check_kernel_memory("accumulate_on_grid", {{"dst", &dst}, {"src", &src}, {"largest", &largest}});
  enqueue(stream, "accumulate_on_grid", {Access::write(dst), Access::read(src), Access::write(largest)},
          [dst, src, exponent, largest] { zerocore::accumulate_on_grid(dst, src, exponent, largest); });
}

void CpuBackend::sum_of_squares(Stream& stream, const std::vector<Tensor>& xs, Mailbox& box, int sum_slot,
                                int finite_slot) {
  check_kernel_memory("sum_of_squares", sum_operands(xs));
  std::vector<Access> accesses{box.write_access(sum_slot), box.write_access(finite_slot)};
  for (const Tensor& x : xs) accesses.push_back(Access::read(x));
  double* sum = box.slot(sum_slot);
  double* finite = box.slot(finite_slot);
  enqueue(stream, "sum_of_squares", accesses,
          [xs, memory = box.buffer(), sum, finite] { sum_of_squares_into(xs, sum, finite); });
}

void CpuBackend::count_nonfinite(Stream& stream, const std::vector<Tensor>& xs, const Tensor& counter) {
  KernelOperands operands = sum_operands(xs);
  operands.emplace_back("counter", &counter);
  check_kernel_memory("count_nonfinite", operands);
  std::vector<Access> accesses{Access::write(counter)};
  for (const Tensor& x : xs) accesses.push_back(Access::read(x));
  enqueue(stream, "count_nonfinite", accesses, [xs, counter] { count_nonfinite_into(xs, counter); });
}

void CpuBackend::adam_update_runs(Stream& stream, const std::vector<AdamOptions>& groups, int64_t step,
                                  double grad_scale, const std::vector<FlatRun>& runs, const Tensor& skip_if) {
  check_kernel_memory("adam_update_runs", update_operands(runs, skip_if));
  enqueue(stream, "adam_update", update_accesses(runs, skip_if), [groups, step, grad_scale, runs, skip_if] {
    if (!skipped(skip_if)) zerocore::adam_update_runs(groups, step, grad_scale, runs);
  });
}

void CpuBackend::sgd_update_runs(Stream& stream, const std::vector<SgdOptions>& groups, int64_t step,
                                 double grad_scale, const std::vector<FlatRun>& runs, const Tensor& skip_if) {
  check_kernel_memory("sgd_update_runs", update_operands(runs, skip_if));
  enqueue(stream, "sgd_update", update_accesses(runs, skip_if), [groups, step, grad_scale, runs, skip_if] {
    if (!skipped(skip_if)) zerocore::sgd_update_runs(groups, step, grad_scale, runs);
  });
}

CpuBackend& default_cpu_backend() {
  static CpuBackend backend;
  return backend;
}

void CpuBackend::check_kernel_memory(const std::string&, const KernelOperands&) const {}

void CpuBackend::declare_access(Stream&, const Access&, const std::string&) {}

void CpuBackend::declare_host_access(const Access&, const std::string&) {}

void CpuBackend::poison(Stream&, const Tensor&) {}

}  // namespace zerocore
