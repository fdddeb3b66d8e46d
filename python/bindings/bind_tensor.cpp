#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bindings.h"
#include "dlpack_tensor.h"
#include "zerocore/runtime/arena.h"
#include "zerocore/error.h"
#include "zerocore/tensor.h"

namespace nb = nanobind;

namespace zerocore::bindings {

DType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32") return DType::kFloat32;
  if (s == "bfloat16" || s == "bf16") return DType::kBFloat16;
  if (s == "float16" || s == "fp16") return DType::kFloat16;
  if (s == "int64") return DType::kInt64;  // Config(deterministic=True)'s exact grad sums
  throw InvalidArgument("unknown dtype '" + s + "'; expected float32, bfloat16, float16 or int64");
}

namespace {

std::string device_string(Device d) {
  return d.type == DeviceType::kCPU ? "cpu" : "cuda:" + std::to_string(d.index);
}

}  // namespace

void bind_tensor(nb::module_& m) {
  nb::class_<Tensor>(m, "Tensor",
                     "A contiguous native tensor. Converts to torch zero-copy with "
                     "torch.from_dlpack(t); its memory lives as long as any holder.")
      .def_prop_ro("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype())); })
      .def_prop_ro("device", [](const Tensor& t) { return device_string(t.device()); })
      .def_prop_ro("shape", [](const Tensor& t) { return nb::tuple(nb::cast(t.shape())); })
      .def_prop_ro("numel", &Tensor::numel)
      .def_prop_ro("nbytes", &Tensor::nbytes)
      .def_prop_ro("data_ptr", [](const Tensor& t) { return uintptr_t(t.data()); })
      .def(
          "__dlpack__",
          [](const Tensor& t, nb::kwargs kwargs) {
            return nb::cast(tensor_to_ndarray(t)).attr("__dlpack__")(**kwargs);
          },
          "DLPack export (array API protocol).")
      .def("__dlpack_device__",
           [](const Tensor& t) { return nb::cast(tensor_to_ndarray(t)).attr("__dlpack_device__")(); })
      .def("__repr__", [](const Tensor& t) {
        std::string shape;
        for (int64_t d : t.shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        return "zerocore.Tensor(shape=(" + shape + "), dtype=" + dtype_name(t.dtype()) +
               ", device=" + device_string(t.device()) + ")";
      });

  m.def(
      "empty",
      [](std::vector<int64_t> shape, const std::string& dtype) {
        return Tensor::empty(std::move(shape), parse_dtype(dtype));
      },
      nb::arg("shape"), nb::arg("dtype") = "float32",
      "A new uninitialised host tensor in its own arena (huge pages when large).");
  m.def(
      "zeros",
      [](std::vector<int64_t> shape, const std::string& dtype) {
        return Tensor::zeros(std::move(shape), parse_dtype(dtype));
      },
      nb::arg("shape"), nb::arg("dtype") = "float32",
      "A new host tensor of zeros in its own arena; a large one holds no resident memory until written.");
  m.def(
      "from_dlpack", [](nb::handle obj) { return tensor_from_dlpack(obj, "tensor"); }, nb::arg("tensor"),
      "Wraps any DLPack tensor's memory (zero-copy); the source stays alive while the result does.");
  m.def("host_arena_bytes", &HostArena::live_bytes, "Bytes held by all live host arenas.");
  m.def("host_arena_allocations", &HostArena::created,
        "Host arenas allocated by this process so far (every native buffer is one; the count only grows).");
}

}  // namespace zerocore::bindings
