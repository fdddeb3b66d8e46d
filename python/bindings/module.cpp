// zerocore._native: the runtime's Python face (with CUDA, its CUDA backend too). Tensors cross as DLPack;
// everything else is plain values.
#include "bindings.h"
#include "dlpack_tensor.h"

NB_MODULE(_native, m) {
  using namespace zerocore::bindings;
  // Engines hold plans in reference cycles with module hooks; those may
  // outlive the interpreter's last collection, which is harmless.
  nanobind::set_leak_warnings(false);
  register_error_translators();
  bind_tensor(m);
  bind_backend(m);
  bind_layout(m);
  bind_cpu(m);
  bind_optim(m);
  bind_comm(m);
  bind_schedule(m);
  bind_store(m);
  bind_step(m);
  bind_engine(m);
#ifdef ZEROCORE_WITH_CUDA
  bind_cuda_backend(m);
#endif
#ifdef ZEROCORE_WITH_NCCL
  bind_nccl(m);
#endif
}
