#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "dlpack_tensor.h"
#include "zerocore/kernels/cpu_exact_grid.h"
#include "zerocore/kernels/cpu_features.h"
#include "zerocore/kernels/crc32c.h"
#include "zerocore/error.h"
#include "zerocore/runtime/thread_pool.h"

namespace nb = nanobind;

namespace zerocore::bindings {

namespace {

// Python's (first, length, exponent or None) runs.
std::vector<GridRun> grid_runs(const std::vector<std::tuple<int64_t, int64_t, std::optional<int>>>& runs) {
  std::vector<GridRun> out;
  out.reserve(runs.size());
  for (const auto& [first, length, exponent] : runs) out.push_back({first, length, exponent});
  return out;
}

}  // namespace

void bind_cpu(nb::module_& m) {
  m.def(
      "cpu_features",
      [] {
        nb::list supported;
        for (Isa isa : supported_isas()) supported.append(isa_name(isa));
        nb::dict d;
        d["isa"] = isa_name(active_isa());
        d["supported"] = supported;
        d["threads"] = num_threads();
        return d;
      },
      "The SIMD path in use ('isa'), the paths this CPU can run, and the thread count.");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
          if (name == isa_name(isa)) return set_cpu_isa(isa);
        }
        throw InvalidArgument("unknown CPU instruction set '" + name + "'; expected scalar, avx2 or avx512");
      },
      nb::arg("isa"), "Forces a SIMD path ('scalar', 'avx2', 'avx512'); it must be supported here.");
  m.def(
      "crc32c",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data, uint32_t crc) {
        nb::gil_scoped_release release;  // a snapshot's checksums run beside the training thread on a device
        return crc32c(data.data(), data.size(), crc);
      },
      nb::arg("data"), nb::arg("crc") = 0,
      "The CRC-32C of data's bytes (a 1-D uint8 CPU array), continued from crc, the CRC-32C of the bytes before "
      "them. See kernels/crc32c.h.");
  m.def(
      "copy_crc32c",
      [](nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> dst,
         nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> src, uint32_t crc) {
        if (dst.size() != src.size()) {
          throw InvalidArgument("copy_crc32c: dst has " + std::to_string(dst.size()) + " bytes, src " +
                                std::to_string(src.size()));
        }
        nb::gil_scoped_release release;
        return copy_crc32c(dst.data(), src.data(), src.size(), crc);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("crc") = 0,
      "Copies src's bytes into dst (1-D uint8 CPU arrays of one size) and returns their CRC-32C continued from "
      "crc, in one pass (a snapshot's copy and checksum). See kernels/crc32c.h.");
  m.def("crc32c_in_hardware", &crc32c_in_hardware, "Whether crc32c runs SSE4.2's instruction here.");
  m.def("set_num_threads", &set_num_threads, nb::arg("threads"), "Threads used by the CPU optimizers.");
  m.def("num_threads", &num_threads);
  m.def(
      "accumulate_on_grid",
      [](nb::handle dst, nb::handle src, int exponent, nb::handle largest) {
        const Tensor d = tensor_from_dlpack(dst, "accumulate_on_grid: dst");
        const Tensor s = tensor_from_dlpack(src, "accumulate_on_grid: src");
        const Tensor l = tensor_from_dlpack(largest, "accumulate_on_grid: largest");
        nb::gil_scoped_release release;
        accumulate_on_grid(d, s, exponent, l);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("exponent"), nb::arg("largest"),
      "Config(deterministic=True): dst (int64) += src * 2**-exponent rounded to nearest, ties to even, on the "
      "host, in one pass; largest (one float32) becomes the largest of itself and every |src| (a NaN or an inf "
      "stays). See kernels/cpu_exact_grid.h.");
  m.def(
      "exact_sums_of_squares",
      [](nb::handle sums, const std::vector<std::tuple<int64_t, int64_t, std::optional<int>>>& runs) {
        const Tensor t = tensor_from_dlpack(sums, "exact_sums_of_squares: sums");
        const std::vector<GridRun> r = grid_runs(runs);
        nb::gil_scoped_release release;
        return exact_sums_of_squares(t, r);
      },
      nb::arg("sums"), nb::arg("runs"),
      "Config(deterministic=True): per run (first, length, exponent or None) of int64 or int40 sums, the exact "
      "sum of their squares as 64-bit words (w0, w1, w2), least significant first, in one call. See "
      "kernels/cpu_exact_grid.h.");
  m.def(
      "mean_of_sums",
      [](nb::handle sums, nb::handle grads, const std::vector<std::tuple<int64_t, int64_t, std::optional<int>>>& runs,
         int64_t count) {
        const Tensor s = tensor_from_dlpack(sums, "mean_of_sums: sums");
        const Tensor g = tensor_from_dlpack(grads, "mean_of_sums: grads");
        const std::vector<GridRun> r = grid_runs(runs);
        nb::gil_scoped_release release;
        mean_of_sums(s, g, r, count);
      },
      nb::arg("sums"), nb::arg("grads"), nb::arg("runs"), nb::arg("count"),
      "Config(deterministic=True): grads = sums * 2**exponent / count, run by run (first, length, exponent; None: "
      "padding, zeros), on the host; the grads may lie in the sums' first bytes. See kernels/cpu_exact_grid.h.");
}

}  // namespace zerocore::bindings
