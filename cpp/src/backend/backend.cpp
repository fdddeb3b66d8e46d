#include "zerocore/backend/backend.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "zerocore/error.h"

namespace zerocore {

struct Backend::LiveBytes {
  std::array<std::atomic<size_t>, 3> of_kind{};  // by MemoryKind
  std::mutex mutex;  // buffers
  struct Live {
    size_t bytes;
    MemoryKind kind;
  };
  std::map<uintptr_t, Live> buffers;  // by start address
};

Backend::Backend() : live_(std::make_shared<LiveBytes>()) {}

struct Backend::Watch {
  double after_seconds;
  std::function<void(double)> stalled;
};

void Backend::watch_host_waits(double after_seconds, std::function<void(double)> stalled) {
  if (stalled && !(after_seconds > 0)) {
    throw InvalidArgument("watch_host_waits: the seconds a host wait waits before it is watched must be positive");
  }
  auto watch = stalled ? std::make_shared<const Watch>(Watch{after_seconds, std::move(stalled)}) : nullptr;
  std::lock_guard<std::mutex> lock(watch_mutex_);
  watch_.swap(watch);  // the old watch goes outside the lock: its function may hold a Python object
}

void Backend::watched_wait(const std::function<bool(double)>& wait_for) const {
  std::shared_ptr<const Watch> watch;
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    watch = watch_;
  }
  if (!watch) {
    wait_for(-1.0);
    return;
  }
  double waited = 0.0;
  while (!wait_for(watch->after_seconds)) {
    waited += watch->after_seconds;
    watch->stalled(waited);
  }
}

size_t Backend::allocated_bytes(MemoryKind kind) const { return live_->of_kind.at(size_t(kind)).load(); }

std::shared_ptr<Buffer> Backend::counted_buffer(MemoryKind kind, Device device, const std::string& name, void* data,
                                                size_t bytes, std::shared_ptr<void> storage) {
  const size_t k = size_t(kind);
  live_->of_kind.at(k) += bytes;
  const auto address = reinterpret_cast<uintptr_t>(data);
  {
    std::lock_guard<std::mutex> lock(live_->mutex);
    live_->buffers[address] = LiveBytes::Live{bytes, kind};
  }
  // Uncounted once the memory is freed (the storage let go first).
  std::shared_ptr<void> counted(data, [storage = std::move(storage), live = live_, k, bytes, address](void*) mutable {
    {
      std::lock_guard<std::mutex> lock(live->mutex);
      live->buffers.erase(address);
    }
    storage.reset();
    live->of_kind[k] -= bytes;
  });
  return std::make_shared<Buffer>(kind, device, name, data, bytes, std::move(counted));
}

std::optional<MemoryKind> Backend::kind_of(const void* data) const {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(live_->mutex);
  auto it = live_->buffers.upper_bound(address);
  if (it == live_->buffers.begin()) return std::nullopt;
  --it;
  if (address - it->first >= it->second.bytes) return std::nullopt;
  return it->second.kind;
}

bool kernel_on_host(const std::string& op, const std::vector<std::pair<std::string, bool>>& operands) {
  const auto host = std::find_if(operands.begin(), operands.end(), [](const auto& o) { return o.second; });
  const auto device = std::find_if(operands.begin(), operands.end(), [](const auto& o) { return !o.second; });
  if (host != operands.end() && device != operands.end()) {
    throw InvalidArgument(op + ": " + host->first + " is host memory and " + device->first +
                          " device memory; a kernel runs on one side (copy one across first)");
  }
  return device == operands.end() && !operands.empty();
}

KernelOperands update_operands(const std::vector<FlatRun>& runs, const Tensor& skip_if) {
  KernelOperands out;
  if (skip_if.data()) out.emplace_back("skip_if", &skip_if);
  for (size_t i = 0; i < runs.size(); ++i) {
    const FlatRun& r = runs[i];
    const std::pair<const char*, const Tensor*> arrays[] = {
        {"param", &r.param}, {"grad", &r.grad}, {"state0", &r.state0}, {"state1", &r.state1}, {"param_copy", &r.param_copy}};
    for (const auto& [name, t] : arrays) {
      if (t->data()) out.emplace_back("run " + std::to_string(i) + "'s " + name, t);
    }
  }
  return out;
}

KernelOperands sum_operands(const std::vector<Tensor>& xs) {
  KernelOperands out;
  for (size_t i = 0; i < xs.size(); ++i) out.emplace_back("xs[" + std::to_string(i) + "]", &xs[i]);
  return out;
}

const char* access_mode_name(AccessMode mode) { return mode == AccessMode::kRead ? "read" : "write"; }

std::vector<Access> update_accesses(const std::vector<FlatRun>& runs, const Tensor& skip_if) {
  std::vector<Access> out;
  if (skip_if.data()) out.push_back(Access::read(skip_if));
  for (const FlatRun& r : runs) {
    out.push_back(Access::write(r.param));
    out.push_back(Access::read(r.grad));
    for (const Tensor* t : {&r.state0, &r.state1, &r.param_copy}) {
      if (t->data()) out.push_back(Access::write(*t));
    }
  }
  return out;
}

}  // namespace zerocore
