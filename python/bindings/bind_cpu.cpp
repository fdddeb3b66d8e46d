#include <nanobind/stl/string.h>

#include <string>

#include "bindings.h"
#include "zerocore/kernels/cpu_features.h"
#include "zerocore/error.h"
#include "zerocore/runtime/thread_pool.h"

namespace nb = nanobind;

namespace zerocore::bindings {

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
  m.def("set_num_threads", &set_num_threads, nb::arg("threads"), "Threads used by the CPU optimizers.");
  m.def("num_threads", &num_threads);
}

}  // namespace zerocore::bindings
