#include "zerocore/backend/backend.h"

namespace zerocore {

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
