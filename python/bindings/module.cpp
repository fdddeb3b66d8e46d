// zerocore._native: the CPU runtime's Python face. Tensors cross as DLPack;
// everything else is plain values.
#include "bindings.h"
#include "dlpack_tensor.h"

NB_MODULE(_native, m) {
  using namespace zerocore::bindings;
  register_error_translators();
  bind_tensor(m);
  bind_layout(m);
  bind_cpu(m);
  bind_optim(m);
}
