// The CUDA backend as Python holds it (zerocore._native.CudaBackend, a
// zerocore._native.Backend), built into _native when zerocore is built with
// CUDA, so the runtime objects of this module can run on it (a C++ object
// cannot cross into the separately linked _cuda module). Making one touches
// no CUDA: the module imports without a driver, and a bad device is reported
// by the first call that uses it. Its compute stream is given as the raw
// cudaStream_t of torch's current stream (torch.cuda.current_stream().cuda_stream).
#include <memory>

#include "bindings.h"
#include "bound_backend.h"
#include "zerocore/cuda_backend.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

void bind_cuda_backend(nb::module_& m) {
  using BoundCuda = HeldBackend<CudaBackend>;
  nb::class_<BoundCuda, BoundBackend>(m, "CudaBackend",
                                      "The CUDA backend of one device: cudaMalloc/cudaHostAlloc buffers, the "
                                      "caller's compute stream, non-blocking streams of its own, CUDA events, async "
                                      "copies.")
      .def(
          "__init__",
          [](BoundCuda* self, int device, uintptr_t compute_stream, bool poison_released) {
            CudaBackendOptions options;
            options.poison_released = poison_released;
            new (self) BoundCuda(
                std::make_unique<CudaBackend>(device, reinterpret_cast<void*>(compute_stream), options));
          },
          "device"_a, "compute_stream"_a = 0, nb::kw_only(), "poison_released"_a = false,
          "A backend on CUDA device `device`; `compute_stream` is a cudaStream_t as an int (0: the legacy default "
          "stream); `poison_released`: fill released slots and staging with NaN (a debug option).")
      .def_prop_ro("device", [](BoundCuda& b) { return b.get().device(); })
      .def_prop_ro("poison_released", [](BoundCuda& b) { return b.get().options().poison_released; })
      .def(
          "set_compute_stream",
          [](BoundCuda& b, uintptr_t handle) { b.get().set_compute_stream(reinterpret_cast<void*>(handle)); },
          "handle"_a,
          "The cudaStream_t (an int) the compute stream stands for from now on: torch's current stream. The new "
          "stream waits on the device for the work the old one was given.")
      .def(
          "stream_handle",
          [](BoundCuda& b, const Stream& s) { return reinterpret_cast<uintptr_t>(b.get().handle(s)); }, "stream"_a,
          "The cudaStream_t of one of the backend's streams, as an int (torch.cuda.ExternalStream takes it).");
}

}  // namespace zerocore::bindings
