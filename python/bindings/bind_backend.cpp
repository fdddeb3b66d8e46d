// The checking CPU backend as Python holds it (zerocore._native.CheckingBackend):
// what the engine needs to run under the checker (buffers, streams, events,
// copies, declared accesses, poison) and to read its verdict (violations,
// host waits). Work on its streams may drop the last reference to a torch
// tensor, which takes the GIL, so everything that can block on that work
// (waits, closing) runs with the GIL released.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>

#include "backend_methods.h"
#include "bindings.h"
#include "dlpack_tensor.h"
#include "process_backend.h"
#include "zerocore/backend/checking_backend.h"
#include "zerocore/error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

using BoundChecking = BoundBackend<CheckingCpuBackend>;

MemoryKind parse_kind(const std::string& s) {
  if (s == "host_pageable") return MemoryKind::kHostPageable;
  if (s == "host_pinned") return MemoryKind::kHostPinned;
  if (s == "device") return MemoryKind::kDevice;
  throw InvalidArgument("unknown memory kind '" + s + "'; expected host_pageable, host_pinned or device");
}

AccessMode parse_mode(const std::string& s) {
  if (s == "read") return AccessMode::kRead;
  if (s == "write") return AccessMode::kWrite;
  throw InvalidArgument("unknown access mode '" + s + "'; expected read or write");
}

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

  auto checking = nb::class_<BoundChecking>(m, "CheckingBackend",
                           "The checking CPU backend: streams as threads with vector clocks, every access to "
                           "its buffers checked for a missing wait, late completion, NaN poison, host waits "
                           "counted.")
      .def(
          "__init__",
          [](BoundChecking* self, uint64_t seed, int64_t min_delay_us, int64_t max_delay_us, bool throw_on_violation) {
            new (self) BoundChecking(std::make_unique<CheckingCpuBackend>(CheckingOptions{seed, min_delay_us, max_delay_us, throw_on_violation}));
          },
          "seed"_a = 0, "min_delay_us"_a = 0, "max_delay_us"_a = 200, "throw_on_violation"_a = true);
  def_backend_methods(checking);
  checking
      .def("violations", [](BoundChecking& b) { return b.get().violations(); },
           "The violations found so far, each naming both accesses and the buffer.")
      .def("check", [](BoundChecking& b) { b.get().check(); }, "Raises StreamOrderError if any violation was found.")
      .def("host_waits", [](BoundChecking& b) { return b.get().host_waits(); })
      .def("take_host_waits", [](BoundChecking& b) { return b.get().take_host_waits(); },
           "The host waits since the last call, resetting the count (once a step).");

  m.def("process_backend", [] { return process_checker() ? "checking" : "cpu"; },
        "The backend this process's comm queues and schedules run on (ZEROCORE_BACKEND).");
  m.def(
      "take_process_host_waits",
      [] {
        CheckingCpuBackend* checker = process_checker();
        if (!checker) throw InvalidArgument("take_process_host_waits: run with ZEROCORE_BACKEND=checking to count");
        return checker->take_host_waits();
      },
      "Blocking host waits of the process's checking backend since the last call, resetting the count.");
}

}  // namespace zerocore::bindings
