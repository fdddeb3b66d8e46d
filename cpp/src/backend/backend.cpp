#include "zerocore/backend/backend.h"

#include <array>
#include <atomic>
#include <utility>

namespace zerocore {

struct Backend::LiveBytes {
  std::array<std::atomic<size_t>, 3> of_kind{};  // by MemoryKind
};

Backend::Backend() : live_(std::make_shared<LiveBytes>()) {}

size_t Backend::allocated_bytes(MemoryKind kind) const { return live_->of_kind.at(size_t(kind)).load(); }

std::shared_ptr<Buffer> Backend::counted_buffer(MemoryKind kind, Device device, const std::string& name, void* data,
                                                size_t bytes, std::shared_ptr<void> storage) {
  const size_t k = size_t(kind);
  live_->of_kind.at(k) += bytes;
  // Uncounted once the memory is freed (the storage let go first).
  std::shared_ptr<void> counted(data, [storage = std::move(storage), live = live_, k, bytes](void*) mutable {
    storage.reset();
    live->of_kind[k] -= bytes;
  });
  return std::make_shared<Buffer>(kind, device, name, data, bytes, std::move(counted));
}

const char* access_mode_name(AccessMode mode) { return mode == AccessMode::kRead ? "read" : "write"; }

std::vector<Access> update_accesses(const std::vector<FlatRun>& runs) {
  std::vector<Access> out;
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
