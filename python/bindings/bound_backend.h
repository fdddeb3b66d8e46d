// The methods every backend bound to Python has (the checking backend's in
// bind_backend.cpp, the CUDA backend's in bind_cuda_backend.cpp): buffers,
// streams, events, copies, fill, declared accesses, poison, on a
// BoundBackend. Waits release the GIL: work they wait for may drop the last
// reference to a torch tensor, which takes it.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>

#include "dlpack_tensor.h"
#include "zerocore/backend/backend.h"

namespace zerocore::bindings {

// "host_pageable", "host_pinned", "device"; "read", "write".
MemoryKind parse_kind(const std::string& s);
AccessMode parse_mode(const std::string& s);

// A backend as Python holds it: closed (its streams drained) when dropped,
// with the GIL released, for the same reason.
template <class B>
class BoundBackend {
 public:
  explicit BoundBackend(std::unique_ptr<B> backend) : backend_(std::move(backend)) {}
  ~BoundBackend() {
    nanobind::gil_scoped_release released;
    backend_.reset();
  }
  BoundBackend(const BoundBackend&) = delete;
  BoundBackend& operator=(const BoundBackend&) = delete;
  B& get() const { return *backend_; }

 private:
  std::unique_ptr<B> backend_;
};

template <class Bound>
void def_backend_methods(nanobind::class_<Bound>& c) {
  namespace nb = nanobind;
  using namespace nb::literals;
  c.def(
       "allocate",
       [](Bound& b, const std::string& kind, size_t nbytes, const std::string& name, bool zeroed) {
         return b.get().allocate(parse_kind(kind), nbytes, name, zeroed);
       },
       "kind"_a, "nbytes"_a, "name"_a, "zeroed"_a = false,
       "A buffer of kind 'host_pageable', 'host_pinned' or 'device'; its contents undefined (NaN under the "
       "checking backend) unless zeroed.")
      .def(
          "compute_stream", [](Bound& b) -> Stream& { return b.get().compute_stream(); },
          nb::rv_policy::reference_internal,
          "The caller's stream: the calling thread on the CPU (work runs inline), torch's current stream on CUDA.")
      .def(
          "create_stream", [](Bound& b, const std::string& name) -> Stream& { return b.get().create_stream(name); },
          "name"_a, nb::rv_policy::reference_internal,
          "A stream of the backend's own (a thread on the CPU, a non-blocking stream on CUDA).")
      .def(
          "record", [](Bound& b, Stream& s) { return b.get().record(s); }, "stream"_a)
      .def(
          "wait", [](Bound& b, Stream& s, const StreamEvent& e) { b.get().wait(s, e); }, "stream"_a, "event"_a,
          nb::call_guard<nb::gil_scoped_release>(), "`stream` waits for `event`.")
      .def(
          "host_wait", [](Bound& b, const StreamEvent& e) { b.get().host_wait(e); }, "event"_a,
          nb::call_guard<nb::gil_scoped_release>(), "The host waits for `event` (the checking backend counts it).")
      .def(
          "query", [](Bound& b, const StreamEvent& e) { return b.get().query(e); }, "event"_a)
      .def(
          "copy",
          [](Bound& b, Stream& s, nb::handle dst, nb::handle src) {
            b.get().copy(s, tensor_from_dlpack(dst, "copy: dst"), tensor_from_dlpack(src, "copy: src"));
          },
          "stream"_a, "dst"_a, "src"_a)
      .def(
          "fill",
          [](Bound& b, Stream& s, nb::handle dst, float value) {
            b.get().fill(s, tensor_from_dlpack(dst, "fill: dst"), value);
          },
          "stream"_a, "dst"_a, "value"_a)
      .def(
          "declare_access",
          [](Bound& b, Stream& s, nb::handle range, const std::string& mode, const std::string& op) {
            const Tensor t = tensor_from_dlpack(range, "declare_access: range");
            b.get().declare_access(s, Access{t.data(), t.nbytes(), parse_mode(mode)}, op);
          },
          "stream"_a, "range"_a, "mode"_a, "op"_a,
          "`stream` (the compute stream for the host's own use) reads or writes `range` directly, as `op`.")
      .def(
          "poison",
          [](Bound& b, Stream& s, nb::handle range) { b.get().poison(s, tensor_from_dlpack(range, "poison: range")); },
          "stream"_a, "range"_a, "Fills a released range with NaN in `stream`'s order.");
}

}  // namespace zerocore::bindings
