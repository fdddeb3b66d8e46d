// Which SIMD path the CPU kernels take, chosen at run time on the machine
// they run on (never by a build-time -march).
#pragma once
#include <vector>

namespace zerocore {

enum class Isa { kScalar, kAvx2, kAvx512 };

const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512"

// Paths this build contains and this CPU (and OS) can run, best last.
std::vector<Isa> supported_isas();

// The path in use: the best supported one unless overridden by
// set_cpu_isa() or the ZEROCORE_CPU_ISA environment variable.
Isa active_isa();

// Throws InvalidArgument when `isa` is not supported here.
void set_cpu_isa(Isa isa);

}  // namespace zerocore
