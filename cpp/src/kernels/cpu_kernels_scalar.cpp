// The portable path: no instruction-set flags.
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"
#include "zerocore/half.h"
#include "zerocore/kernels/element_math.h"

namespace zerocore::cpu {
namespace scalar_isa {
#include "cpu_vec_scalar.h"
#include "cpu_kernels_impl.h"
}  // namespace scalar_isa

const KernelTable& scalar_kernels() { return scalar_isa::kernel_table<scalar_isa::ScalarVec>(); }

}  // namespace zerocore::cpu
