// The backends as Python holds them (zerocore._native.Backend and its
// CpuBackend and CheckingBackend; CudaBackend in bind_cuda_backend.cpp):
// what the engine and the tests do on one (buffers and the bytes it holds,
// streams, events, copies, fill, declared accesses, poison), the checking
// backend's verdict (violations, host waits), and the process's default
// backend. Waits and closing release the GIL: work on a backend's streams
// may drop the last reference to a torch tensor, which takes it.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <iterator>
#include <memory>
#include <string>

#include "bindings.h"
#include "bound_backend.h"
#include "dlpack_tensor.h"
#include "process_backend.h"
#include "python_transport.h"
#include "zerocore/backend/checking_backend.h"
#include "zerocore/error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

using BoundCpu = HeldBackend<CpuBackend>;
using BoundChecking = HeldBackend<CheckingCpuBackend>;

namespace {
// Python's names of the memory kinds, in MemoryKind's order.
constexpr const char* kKindNames[] = {"host_pageable", "host_pinned", "device"};
}  // namespace

MemoryKind parse_kind(const std::string& s) {
  for (size_t i = 0; i < std::size(kKindNames); ++i) {
    if (s == kKindNames[i]) return MemoryKind(i);
  }
  throw InvalidArgument("unknown memory kind '" + s + "'; expected host_pageable, host_pinned or device");
}

AccessMode parse_mode(const std::string& s) {
  if (s == "read") return AccessMode::kRead;
  if (s == "write") return AccessMode::kWrite;
  throw InvalidArgument("unknown access mode '" + s + "'; expected read or write");
}

namespace {

void bind_backend_base(nb::module_& m) {
  nb::enum_<StreamPlane>(m, "StreamPlane", "What a stream's work is (stream.h): the device's, or the control plane's.")
      .value("DEVICE", StreamPlane::kDevice)
      .value("CONTROL", StreamPlane::kControl);
  nb::class_<BoundBackend>(m, "Backend",
                           "A backend of the runtime (docs/runtime.md, \"The backend seam\"): CpuBackend, "
                           "CheckingBackend or CudaBackend. What is made on one (a CommQueue, a PartitionStore, an "
                           "OffloadOptimizer) keeps it alive.")
      .def(
          "allocate",
          [](BoundBackend& b, const std::string& kind, size_t nbytes, const std::string& name, bool zeroed) {
            return b.get().allocate(parse_kind(kind), nbytes, name, zeroed);
          },
          "kind"_a, "nbytes"_a, "name"_a, "zeroed"_a = false,
          "A buffer of kind 'host_pageable', 'host_pinned' or 'device'; its contents undefined (NaN under the "
          "checking backend) unless zeroed.")
      .def(
          "allocated_bytes",
          [](BoundBackend& b) {
            nb::dict out;
            for (const char* kind : kKindNames) out[kind] = b.get().allocated_bytes(parse_kind(kind));
            return out;
          },
          "Bytes of the buffers this backend allocated that are alive, by kind ('host_pageable', 'host_pinned', "
          "'device'): a buffer counts until its last view (a torch tensor's too) is dropped.")
      .def(
          "compute_stream", [](BoundBackend& b) -> Stream& { return b.get().compute_stream(); },
          nb::rv_policy::reference_internal,
          "The caller's stream: the calling thread on the CPU (work runs inline), torch's current stream on CUDA.")
      .def(
          "create_stream",
          [](BoundBackend& b, const std::string& name) -> Stream& { return b.get().create_stream(name); }, "name"_a, nb::rv_policy::reference_internal,
          "A stream of the backend's own (a thread on the CPU, a non-blocking stream on CUDA).")
      .def(
          "record", [](BoundBackend& b, Stream& s) { return b.get().record(s); }, "stream"_a)
      .def(
          "wait", [](BoundBackend& b, Stream& s, const StreamEvent& e) { b.get().wait(s, e); }, "stream"_a,
          "event"_a, nb::call_guard<nb::gil_scoped_release>(), "`stream` waits for `event`.")
      .def(
          "host_wait", [](BoundBackend& b, const StreamEvent& e) { b.get().host_wait(e); }, "event"_a,
          nb::call_guard<nb::gil_scoped_release>(), "The host waits for `event` (the checking backend counts it).")
      .def(
          "query", [](BoundBackend& b, const StreamEvent& e) { return b.get().query(e); }, "event"_a)
      .def(
          "watch_host_waits",
          [](BoundBackend& b, double after_seconds, nb::object stalled) {
            if (stalled.is_none()) {
              b.get().watch_host_waits(after_seconds, nullptr);
              return;
            }
            // Dropped under the GIL (a waiting thread may hold the last reference).
            auto held = std::shared_ptr<nb::object>(new nb::object(std::move(stalled)), [](nb::object* f) {
              if (!Py_IsInitialized()) return;  // after interpreter shutdown the object is left to the OS
              nb::gil_scoped_acquire gil;
              delete f;
            });
            b.get().watch_host_waits(after_seconds, [held](double waited) {
              nb::gil_scoped_acquire gil;
              try {
                (*held)(waited);
              } catch (const nb::python_error& e) {
                rethrow_for_native(e);
              }
            });
          },
          "after_seconds"_a, "stalled"_a.none(),
          "A blocking host wait (host_wait, and on the CPU the compute stream's wait) that has waited "
          "after_seconds calls stalled(seconds waited), with the GIL, and again every after_seconds while it goes on; "
          "what it raises ends the wait (a RankDisagreementError raised again as itself). None: waits whole.")
      .def(
          "copy",
          [](BoundBackend& b, Stream& s, nb::handle dst, nb::handle src) {
            b.get().copy(s, tensor_from_dlpack(dst, "copy: dst"), tensor_from_dlpack(src, "copy: src"));
          },
          "stream"_a, "dst"_a, "src"_a)
      .def(
          "fill",
          [](BoundBackend& b, Stream& s, nb::handle dst, float value) {
            b.get().fill(s, tensor_from_dlpack(dst, "fill: dst"), value);
          },
          "stream"_a, "dst"_a, "value"_a)
      .def(
          "declare_access",
          [](BoundBackend& b, Stream& s, nb::handle range, const std::string& mode, const std::string& op) {
            const Tensor t = tensor_from_dlpack(range, "declare_access: range");
            b.get().declare_access(s, Access{t.data(), t.nbytes(), parse_mode(mode)}, op);
          },
          "stream"_a, "range"_a, "mode"_a, "op"_a,
          "Work on `stream` (torch's, on the compute stream) reads or writes `range` directly, as `op`.")
      .def(
          "declare_host_access",
          [](BoundBackend& b, nb::handle range, const std::string& mode, const std::string& op) {
            const Tensor t = tensor_from_dlpack(range, "declare_host_access: range");
            b.get().declare_host_access(Access{t.data(), t.nbytes(), parse_mode(mode)}, op);
          },
          "range"_a, "mode"_a, "op"_a,
          "The host itself reads or writes `range`, as `op`: ordered after a stream's work only by a host wait.")
      .def(
          "poison",
          [](BoundBackend& b, Stream& s, nb::handle range) {
            b.get().poison(s, tensor_from_dlpack(range, "poison: range"));
          },
          "stream"_a, "range"_a, "Fills a released range with NaN in `stream`'s order.");
}

}  // namespace

void bind_backend(nb::module_& m) {
  nb::exception<StreamOrderError>(m, "StreamOrderError", PyExc_RuntimeError);
  nb::class_<Stream>(m, "Stream", "A stream of a backend (alive as long as the backend).")
      .def_prop_ro("name", &Stream::name);
  nb::class_<StreamEvent>(m, "StreamEvent", "A point of a stream, recorded by Backend.record.");
  nb::class_<Buffer>(m, "Buffer", "One allocation of a memory kind; view() gives tensors into it.")
      .def_prop_ro("name", &Buffer::name)
      .def_prop_ro("nbytes", &Buffer::bytes)
      .def_prop_ro("kind", [](const Buffer& b) { return std::string(memory_kind_name(b.kind())); })
      .def(
          "view",
          [](const Buffer& b, size_t byte_offset, const std::string& dtype, std::vector<int64_t> shape) {
            return b.view(byte_offset, parse_dtype(dtype), std::move(shape));
          },
          "byte_offset"_a, "dtype"_a, "shape"_a, "A tensor into the buffer (torch.from_dlpack converts it).");

  bind_backend_base(m);
  nb::class_<BoundCpu, BoundBackend>(m, "CpuBackend",
                                     "The plain CPU backend CPU training runs on: host arenas, the calling thread "
                                     "as the compute stream, a thread for every other stream.")
      .def("__init__", [](BoundCpu* self) { new (self) BoundCpu(std::make_unique<CpuBackend>()); });
  nb::class_<BoundChecking, BoundBackend>(m, "CheckingBackend",
                                          "The checking CPU backend: streams as threads with vector clocks, every "
                                          "access to its buffers checked for a missing wait, late completion, NaN "
                                          "poison, host waits counted.")
      .def(
          "__init__",
          [](BoundChecking* self, uint64_t seed, int64_t min_delay_us, int64_t max_delay_us, bool throw_on_violation,
             bool compute_inline) {
            new (self) BoundChecking(std::make_unique<CheckingCpuBackend>(
                CheckingOptions{seed, min_delay_us, max_delay_us, throw_on_violation, compute_inline}));
          },
          "seed"_a = 0, "min_delay_us"_a = 0, "max_delay_us"_a = 200, "throw_on_violation"_a = true,
          "compute_inline"_a = true,
          "compute_inline=False: the engine treats the compute stream as a GPU's (a step's device verdict is "
          "read at a later exchange), though it runs on the calling thread.")
      .def("violations", [](BoundChecking& b) { return b.get().violations(); },
           "The violations found so far, each naming both accesses and the buffer.")
      .def("check", [](BoundChecking& b) { b.get().check(); }, "Raises StreamOrderError if any violation was found.")
      .def("host_waits", [](BoundChecking& b) { return b.get().host_waits(); })
      .def("take_host_waits", [](BoundChecking& b) { return b.get().take_host_waits(); },
           "The host waits since the last call, resetting the count (once a step).")
      .def("device_waits", [](BoundChecking& b) { return b.get().device_waits(); })
      .def("device_allocations", [](BoundChecking& b) { return b.get().device_allocations(); },
           "allocate() calls for device memory so far.")
      .def("ordered_after", [](BoundChecking& b, const Stream& stream, const Stream& of) {
             return b.get().ordered_after(stream, of);
           }, "stream"_a, "of"_a,
           "(operations enqueued on `of`, of them those `stream` is ordered after), by the checker's clocks.")
      .def("device_work", [](BoundChecking& b) { return b.get().device_work(); },
           "(operations enqueued on device-plane streams, those of them the host is ordered after): the host's "
           "lead over the device, by the checker's clocks.")
      .def("take_device_waits", [](BoundChecking& b) { return b.get().take_device_waits(); },
           "Of the host waits since the last call, those that waited for device work (a device-plane stream's, "
           "checking_backend.h), resetting the count.");

  m.def("process_backend", &process_backend, nb::rv_policy::reference,
        "The process's default backend (ZEROCORE_BACKEND: the plain CpuBackend, or a CheckingBackend under "
        "ZEROCORE_BACKEND=checking), which an engine on the CPU runs on unless given one.");
}

}  // namespace zerocore::bindings
