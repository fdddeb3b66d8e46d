// A pool of equal-size host buffers ("slots") handed from one use to the
// next by the schedule: stage 3's gathered units, the staging buckets of
// gradient reduction. The planned slots are one arena allocated up front, so
// steady-state training allocates nothing and peak memory follows from the
// plan whatever the system allocator does. A slot beyond the plan (units
// nested deeper than planned, grads arriving far out of plan order) is an
// arena of its own, made when first needed and kept, so it too is allocated
// once; bytes() reports every slot. Slots are allocated through the Backend
// the pool is given, so under the checking backend every access to them is
// checked and a released slot can be poisoned.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zerocore/backend/backend.h"
#include "zerocore/tensor.h"

namespace zerocore {

class SlotPool {
 public:
  SlotPool() = default;  // no slots and no backend: a place to assign a pool to
  // `planned` slots of `slot_elems` elements each (rounded up so every slot
  // starts on a cache line), memory of `kind` from `backend` (which must
  // outlive the pool), named `name` in the checker's reports.
  SlotPool(DType dtype, int64_t slot_elems, int planned, Backend& backend, MemoryKind kind = MemoryKind::kDevice,
           std::string name = "slot pool");

  // A free slot, or -1 when all are taken.
  int try_acquire();
  // A free slot, adding one to the pool when all are taken.
  int acquire();
  // Gives a slot back; its contents are left as they are.
  void release(int slot);
  // Gives a slot back after its last use, on `last_use`: the backend
  // poisons it in that stream's order (the checking backend fills it with
  // NaN, so a read of a released slot shows; the plain one does nothing).
  void release(int slot, Stream& last_use);

  int free_slots() const { return int(std::count(free_.begin(), free_.end(), true)); }
  const Tensor& slot(int index) const { return slots_[size_t(index)]; }
  int size() const { return int(slots_.size()); }
  int planned() const { return planned_; }
  int64_t slot_elems() const { return slot_elems_; }
  size_t bytes() const { return slots_.size() * size_t(slot_elems_) * dtype_size(dtype_); }

 private:
  Backend* backend_ = nullptr;
  MemoryKind kind_ = MemoryKind::kDevice;
  std::string name_;
  DType dtype_ = DType::kFloat32;
  int64_t slot_elems_ = 0;
  int planned_ = 0;
  std::vector<Tensor> slots_;
  std::vector<bool> free_;
};

}  // namespace zerocore
