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

#include "bindings.h"
#include "dlpack_tensor.h"
#include "process_backend.h"
#include "zerocore/backend/checking_backend.h"
#include "zerocore/error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace zerocore::bindings {

namespace {

// Closed (its streams drained and joined) when dropped, with the GIL released.
class BoundBackend {
 public:
  explicit BoundBackend(const CheckingOptions& options) : backend_(std::make_unique<CheckingCpuBackend>(options)) {}
  ~BoundBackend() {
    nb::gil_scoped_release released;
    backend_.reset();
  }
  BoundBackend(const BoundBackend&) = delete;
  BoundBackend& operator=(const BoundBackend&) = delete;
  CheckingCpuBackend& get() const { return *backend_; }

 private:
  std::unique_ptr<CheckingCpuBackend> backend_;
};

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

  nb::class_<BoundBackend>(m, "CheckingBackend",
                           "The checking CPU backend: streams as threads with vector clocks, every access to "
                           "its buffers checked for a missing wait, late completion, NaN poison, host waits "
                           "counted.")
      .def(
          "__init__",
          [](BoundBackend* self, uint64_t seed, int64_t min_delay_us, int64_t max_delay_us, bool throw_on_violation) {
            new (self) BoundBackend(CheckingOptions{seed, min_delay_us, max_delay_us, throw_on_violation});
          },
          "seed"_a = 0, "min_delay_us"_a = 0, "max_delay_us"_a = 200, "throw_on_violation"_a = true)
      .def(
          "allocate",
          [](BoundBackend& b, const std::string& kind, size_t nbytes, const std::string& name, bool zeroed) {
            return b.get().allocate(parse_kind(kind), nbytes, name, zeroed);
          },
          "kind"_a, "nbytes"_a, "name"_a, "zeroed"_a = false,
          "A buffer of kind 'host_pageable', 'host_pinned' or 'device'; NaN unless zeroed.")
      .def(
          "compute_stream", [](BoundBackend& b) -> Stream& { return b.get().compute_stream(); },
          nb::rv_policy::reference_internal, "The caller's stream: work on it runs inline.")
      .def(
          "create_stream", [](BoundBackend& b, const std::string& name) -> Stream& { return b.get().create_stream(name); },
          "name"_a, nb::rv_policy::reference_internal, "A stream of its own thread.")
      .def(
          "record", [](BoundBackend& b, Stream& s) { return b.get().record(s); }, "stream"_a)
      .def(
          "wait", [](BoundBackend& b, Stream& s, const StreamEvent& e) { b.get().wait(s, e); }, "stream"_a,
          "event"_a, nb::call_guard<nb::gil_scoped_release>(), "`stream` waits for `event`.")
      .def(
          "host_wait", [](BoundBackend& b, const StreamEvent& e) { b.get().host_wait(e); }, "event"_a,
          nb::call_guard<nb::gil_scoped_release>(), "The host waits for `event` (counted).")
      .def(
          "query", [](BoundBackend& b, const StreamEvent& e) { return b.get().query(e); }, "event"_a)
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
          "`stream` (the compute stream for the host's own use) reads or writes `range` directly, as `op`.")
      .def(
          "poison",
          [](BoundBackend& b, Stream& s, nb::handle range) {
            b.get().poison(s, tensor_from_dlpack(range, "poison: range"));
          },
          "stream"_a, "range"_a, "Fills a released range with NaN in `stream`'s order.")
      .def("violations", [](BoundBackend& b) { return b.get().violations(); },
           "The violations found so far, each naming both accesses and the buffer.")
      .def("check", [](BoundBackend& b) { b.get().check(); }, "Raises StreamOrderError if any violation was found.")
      .def("host_waits", [](BoundBackend& b) { return b.get().host_waits(); })
      .def("take_host_waits", [](BoundBackend& b) { return b.get().take_host_waits(); },
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
