#include "zerocore/schedule/slot_pool.h"

#include <stdexcept>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

namespace {
constexpr size_t kLineBytes = 64;
}

SlotPool::SlotPool(DType dtype, int64_t slot_elems, int planned, Backend& backend, MemoryKind kind, std::string name)
    : backend_(&backend), kind_(kind), name_(std::move(name)), dtype_(dtype), planned_(planned) {
  if (slot_elems < 0 || planned < 0) {
    throw InvalidArgument("SlotPool: " + std::to_string(planned) + " slots of " + std::to_string(slot_elems) +
                          " elements");
  }
  const int64_t line = int64_t(kLineBytes / dtype_size(dtype));
  slot_elems_ = (slot_elems + line - 1) / line * line;
  if (planned == 0) return;
  auto buffer = backend.allocate(kind, size_t(planned) * size_t(slot_elems_) * dtype_size(dtype), name_);
  for (int i = 0; i < planned; ++i) {
    slots_.push_back(buffer->view(size_t(i) * size_t(slot_elems_) * dtype_size(dtype), dtype, {slot_elems_}));
    free_.push_back(true);
  }
}

int SlotPool::try_acquire() {
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i]) {
      free_[i] = false;
      return int(i);
    }
  }
  return -1;
}

int SlotPool::acquire() {
  const int slot = try_acquire();
  if (slot >= 0) return slot;
  if (backend_ == nullptr) throw std::logic_error("SlotPool: acquire() on a pool made without a backend");
  slots_.push_back(Tensor::empty({slot_elems_}, dtype_, *backend_, kind_, name_ + " (beyond plan)"));
  free_.push_back(false);
  return int(slots_.size()) - 1;
}

void SlotPool::release(int slot) {
  if (slot < 0 || slot >= size() || free_[size_t(slot)]) {
    throw InvalidArgument("SlotPool: slot " + std::to_string(slot) + " is not taken");
  }
  free_[size_t(slot)] = true;
}

void SlotPool::release(int slot, Stream& last_use) {
  release(slot);
  backend_->poison(last_use, slots_[size_t(slot)]);
}

}  // namespace zerocore
