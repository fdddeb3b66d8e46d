#include "zerocore/backend/checking_backend.h"

#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "order_checker.h"
#include "zerocore/runtime/arena.h"
#include "zerocore/error.h"

namespace zerocore {

namespace {
// All-ones bytes are a NaN in every float type the runtime uses (fp32,
// bf16, fp16, and the mailbox's fp64).
constexpr int kNanByte = 0xFF;
}  // namespace

CheckingCpuBackend::CheckingCpuBackend(CheckingOptions options)
    : options_(options), checker_(std::make_shared<OrderChecker>()) {
  if (options.min_delay_us < 0 || options.max_delay_us < options.min_delay_us) {
    throw InvalidArgument("CheckingOptions: delays must satisfy 0 <= min_delay_us <= max_delay_us, got [" +
                          std::to_string(options.min_delay_us) + ", " + std::to_string(options.max_delay_us) + "]");
  }
  delays_.emplace_back(options.seed);  // the compute stream runs inline: never delayed
  planes_.push_back(StreamPlane::kDevice);
}

CheckingCpuBackend::~CheckingCpuBackend() = default;

std::shared_ptr<Buffer> CheckingCpuBackend::allocate(MemoryKind kind, size_t bytes, const std::string& name,
                                                     bool zeroed) {
  auto arena = HostArena::create(bytes, zeroed);
  if (!zeroed) std::memset(arena->data(), kNanByte, bytes);
  // The buffer leaves the checker's registry when its memory is freed.
  std::shared_ptr<void> storage(arena->data(),
                                [arena, checker = checker_](void* data) { checker->remove_buffer(data); });
  auto buffer = counted_buffer(kind, Device{}, name, arena->data(), bytes, std::move(storage));
  checker_->add_buffer(*buffer);
  if (kind == MemoryKind::kDevice) ++device_allocations_;
  return buffer;
}

Stream& CheckingCpuBackend::create_stream(const std::string& name, StreamPlane plane) {
  Stream& stream = CpuBackend::create_stream(name, plane);
  std::lock_guard<std::mutex> lock(mutex_);
  // By index: streams made on two threads at once may arrive here in either order.
  const size_t index = size_t(index_of(stream));
  if (delays_.size() <= index) delays_.resize(index + 1);
  delays_[index].seed(options_.seed + uint64_t(index));
  if (planes_.size() <= index) planes_.resize(index + 1, StreamPlane::kDevice);
  planes_[index] = plane;
  return stream;
}

void CheckingCpuBackend::checked(Stream& stream, const std::string& op, const std::vector<Access>& accesses) {
  report(checker_->access(clock_index(stream), stream.name(), op, accesses));
}

void CheckingCpuBackend::report(const std::vector<std::string>& found) {
  if (found.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  violations_.insert(violations_.end(), found.begin(), found.end());
  if (options_.throw_on_violation) throw StreamOrderError(found.front());
}

std::shared_ptr<StreamEvent> CheckingCpuBackend::record(Stream& stream) {
  return record_with(stream, checker_->clock(clock_index(stream)));
}

std::shared_ptr<StreamEvent> CheckingCpuBackend::record_done(Stream& stream, std::shared_ptr<Event> done) {
  return std::make_shared<CpuEvent>(std::move(done), checker_->clock(clock_index(stream)));
}

void CheckingCpuBackend::wait(Stream& stream, const StreamEvent& event) {
  CpuBackend::wait(stream, event);
  checker_->join(clock_index(stream), static_cast<const CpuEvent&>(event).clock());
}

void CheckingCpuBackend::host_wait(const StreamEvent& event) {
  ++host_waits_;
  CpuBackend::host_wait(event);
  const std::vector<int> grew = checker_->join(OrderChecker::kHostStream, static_cast<const CpuEvent&>(event).clock());
  std::lock_guard<std::mutex> lock(mutex_);
  for (int clock : grew) {
    if (clock != OrderChecker::kHostStream && planes_.at(size_t(clock - 1)) == StreamPlane::kDevice) {
      ++device_waits_;
      return;
    }
  }
}

std::pair<uint64_t, uint64_t> CheckingCpuBackend::device_work() {
  std::vector<StreamPlane> planes;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    planes = planes_;
  }
  const std::vector<uint64_t> host = checker_->clock(OrderChecker::kHostStream);
  uint64_t enqueued = 0, seen = 0;
  for (size_t i = 0; i < planes.size(); ++i) {
    if (planes[i] != StreamPlane::kDevice) continue;
    const size_t clock = i + 1;
    const std::vector<uint64_t> own = checker_->clock(int(clock));
    enqueued += clock < own.size() ? own[clock] : 0;
    seen += clock < host.size() ? host[clock] : 0;
  }
  return {enqueued, seen};
}

bool CheckingCpuBackend::query(const StreamEvent& event) {
  if (!CpuBackend::query(event)) return false;
  // Seeing the event complete orders the host after it, as a host wait does.
  checker_->join(OrderChecker::kHostStream, static_cast<const CpuEvent&>(event).clock());
  return true;
}

void CheckingCpuBackend::check_kernel_memory(const std::string& op, const KernelOperands& operands) const {
  std::vector<std::pair<std::string, bool>> sides;
  for (const auto& [name, t] : operands) {
    const std::optional<MemoryKind> kind = kind_of(t->data());
    sides.emplace_back(name, kind && *kind != MemoryKind::kDevice);
  }
  kernel_on_host(op, sides);
}

void CheckingCpuBackend::enqueue(Stream& stream, const std::string& op, const std::vector<Access>& accesses,
                                 std::function<void()> body) {
  checked(stream, op, accesses);
  const int index = index_of(stream);
  if (index == kCompute) {
    CpuBackend::enqueue(stream, op, accesses, std::move(body));
    return;
  }
  int64_t delay_us;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    delay_us = std::uniform_int_distribution<int64_t>(options_.min_delay_us,
                                                      options_.max_delay_us)(delays_[size_t(index)]);
  }
  CpuBackend::enqueue(stream, op, accesses, [delay_us, body = std::move(body)] {
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    body();
  });
}

void CheckingCpuBackend::declare_access(Stream& stream, const Access& access, const std::string& op) {
  checked(stream, op, {access});
}

void CheckingCpuBackend::declare_host_access(const Access& access, const std::string& op) {
  report(checker_->access(OrderChecker::kHostStream, "host", op, {access}));
}

int CheckingCpuBackend::clock_index(const Stream& stream) const { return index_of(stream) + 1; }

void CheckingCpuBackend::poison(Stream& stream, const Tensor& range) {
  enqueue(stream, "poison", {Access::write(range)},
          [range] { std::memset(range.data(), kNanByte, range.nbytes()); });
}

std::vector<std::string> CheckingCpuBackend::violations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return violations_;
}

void CheckingCpuBackend::check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (violations_.empty()) return;
  throw StreamOrderError(std::to_string(violations_.size()) + " stream-order violation(s); the first: " +
                         violations_.front());
}

}  // namespace zerocore
