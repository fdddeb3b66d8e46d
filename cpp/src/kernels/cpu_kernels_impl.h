// The optimizer kernels' loops over a vector-traits type V (width, register
// type, loads/stores with 16-bit conversion, arithmetic); the per-element
// math is element_math.h's, shared with the CUDA kernels. Each
// cpu_kernels_<isa>.cpp includes this file inside its own namespace after
// defining its traits, and compiles it with its own instruction-set flags;
// the namespace keeps one path's instantiations from replacing another's at
// link time.
//
// Every path performs the same IEEE operations in the same order, with
// explicit fused multiply-adds (the kernel files are built with
// -ffp-contract=off), so all paths give bit-identical results and the
// portable scalar path is the reference for the SIMD ones.
//
// Expects, in the enclosing namespace: struct ScalarVec and the including
// file's own traits; in scope: cpu_kernels.h, half.h and element_math.h.

using kernels::Bf16;
using kernels::Fp16;
using kernels::NoCopy;

// Calls f(G{}, C{}) with G the gradient element type and C the copy type.
template <class F>
inline void with_element_types(const FlatArgs& a, F&& f) {
  auto with_copy = [&](auto g) {
    if (!a.copy) {
      f(g, NoCopy{});
    } else if (a.copy_dtype == DType::kBFloat16) {
      f(g, Bf16{});
    } else {
      f(g, Fp16{});
    }
  };
  kernels::with_element_type(a.grad_dtype, with_copy);
}

// Calls at(vec, grad, copy, i) for whole vectors of V over [begin, end),
// then for the tail element by element with ScalarVec; `vec` is a value of
// the traits type to use, `grad` and `copy` typed pointers.
template <class V, class At>
inline void for_each_element(const FlatArgs& a, int64_t begin, int64_t end, At&& at) {
  with_element_types(a, [&](auto g_type, auto c_type) {
    using G = decltype(g_type);
    using C = decltype(c_type);
    const G* g = static_cast<const G*>(a.grad);
    C* copy = static_cast<C*>(a.copy);
    int64_t i = begin;
    for (; i + V::width <= end; i += V::width) at(V{}, g, copy, i);
    for (; i < end; ++i) at(ScalarVec{}, g, copy, i);
  });
}

// Both kernels copy their arguments: they store through float pointers,
// which the compiler must assume may alias the caller's structs, and would
// otherwise reload every coefficient on every vector.
template <class V>
void adam_kernel(const AdamCoefs& coefs, const FlatArgs& args, int64_t begin, int64_t end) {
  const AdamCoefs c = coefs;
  const FlatArgs a = args;
  for_each_element<V>(a, begin, end, [&](auto vec, auto g, auto copy, int64_t i) {
    kernels::adam_at<decltype(vec)>(c, a.param, g, a.state0, a.state1, copy, i);
  });
}

template <class V>
void sgd_kernel(const SgdCoefs& coefs, const FlatArgs& args, int64_t begin, int64_t end) {
  const SgdCoefs c = coefs;
  const FlatArgs a = args;
  for_each_element<V>(a, begin, end, [&](auto vec, auto g, auto copy, int64_t i) {
    kernels::sgd_at<decltype(vec)>(c, a.param, g, a.state0, copy, i);
  });
}

template <class V>
const KernelTable& kernel_table() {
  static const KernelTable table{&adam_kernel<V>, &sgd_kernel<V>};
  return table;
}
