#include "zerocore/kernels/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "zerocore/error.h"

namespace zerocore {

namespace {

bool cpu_runs(Isa isa) {
#if defined(__x86_64__) || defined(_M_X64)
  // __builtin_cpu_supports also checks that the OS saves the wider
  // registers (XCR0), so a hypervisor that hides AVX-512 state is honoured.
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) return isa;
  }
  throw InvalidArgument("unknown CPU instruction set '" + name + "'; expected scalar, avx2 or avx512");
}

Isa initial_isa() {
  const auto supported = supported_isas();
  if (const char* env = std::getenv("ZEROCORE_CPU_ISA"); env && *env) {
    const Isa wanted = parse_isa(env);
    for (Isa isa : supported) {
      if (isa == wanted) return isa;
    }
    throw InvalidArgument(std::string("ZEROCORE_CPU_ISA=") + env + " is not supported on this CPU");
  }
  return supported.back();
}

std::atomic<int>& active() {
  static std::atomic<int> isa{int(initial_isa())};
  return isa;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (cpu_runs(isa)) out.push_back(isa);
  }
  return out;
}

Isa active_isa() { return Isa(active().load()); }

void set_cpu_isa(Isa isa) {
  if (!cpu_runs(isa)) {
    throw InvalidArgument(std::string("CPU instruction set '") + isa_name(isa) +
                          "' is not supported on this machine");
  }
  active() = int(isa);
}

}  // namespace zerocore
