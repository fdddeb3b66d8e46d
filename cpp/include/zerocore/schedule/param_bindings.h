// What the caller's params view, kept by the schedule so that the caller
// (Python binds each unit's nn.Parameters to its buffer) never asks where
// a unit is: each hook hands back a Binding, the buffer its unit is in and
// the units whose buffers moved or went back since the caller last heard.
// Kept apart from the gather pool: the pool knows where units are now,
// this only what the caller was last told.
#pragma once
#include <vector>

#include "zerocore/schedule/gather_pool.h"
#include "zerocore/tensor.h"

namespace zerocore {

// What a hook hands back to its caller: the buffer the hook's unit is
// gathered in (the pre hooks), whether the caller's params do not view it
// yet, and the units released (or moved) since the caller last heard,
// whose params must stop viewing their old buffers.
struct ParamBinding {
  Tensor buffer;
  bool rebind = false;
  std::vector<int> released;
};

class ParamBindings {
 public:
  explicit ParamBindings(const GatherPool& pool) : pool_(pool), bound_(size_t(pool.num_units()), nullptr) {}
  // The caller's params of `unit` view its buffer from now on (a pre hook).
  ParamBinding bind(int unit);
  // Only what was released since the caller last heard (the post hooks).
  ParamBinding unbound() { return ParamBinding{Tensor(), false, take_released()}; }
  // The units whose buffer is not the one the caller's params view, forgotten as bound.
  std::vector<int> take_released();
  // The caller dropped every binding, so the next hook binds afresh.
  void unbind_all();

 private:
  const GatherPool& pool_;
  std::vector<const void*> bound_;  // per unit: the buffer the caller's params view, as last handed back
};

}  // namespace zerocore
