// The optimizer kernels, written once over a vector-traits type V (width,
// register type, loads/stores with 16-bit conversion, arithmetic). Each
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
// file's own traits; in scope: cpu_kernels.h and half.h.

struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};
struct NoCopy {};

template <class V>
inline typename V::reg load(const float* p) {
  return V::load_f32(p);
}
template <class V>
inline typename V::reg load(const Bf16* p) {
  return V::load_bf16(&p->bits);
}
template <class V>
inline typename V::reg load(const Fp16* p) {
  return V::load_fp16(&p->bits);
}
template <class V>
inline void store_copy(Bf16* p, typename V::reg x) {
  V::store_bf16(&p->bits, x);
}
template <class V>
inline void store_copy(Fp16* p, typename V::reg x) {
  V::store_fp16(&p->bits, x);
}
template <class V>
inline void store_copy(NoCopy*, typename V::reg) {}

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
  switch (a.grad_dtype) {
    case DType::kFloat32: with_copy(float{}); break;
    case DType::kBFloat16: with_copy(Bf16{}); break;
    case DType::kFloat16: with_copy(Fp16{}); break;
  }
}

template <class V, class G, class C>
inline void adam_at(const AdamCoefs& c, float* p, const G* g, float* m, float* v, C* copy, int64_t i) {
  using R = typename V::reg;
  R grad = V::mul(load<V>(g + i), V::set1(c.grad_scale));
  R param = V::load_f32(p + i);
  if (c.l2_decay != 0.0f) grad = V::fma(V::set1(c.l2_decay), param, grad);
  if (c.param_decay != 1.0f) param = V::mul(param, V::set1(c.param_decay));
  const R m1 = V::fma(V::set1(c.beta1), V::load_f32(m + i), V::mul(V::set1(c.one_minus_beta1), grad));
  const R v1 = V::fma(V::set1(c.beta2), V::load_f32(v + i),
                      V::mul(V::mul(V::set1(c.one_minus_beta2), grad), grad));
  const R denom = V::fma(V::sqrt(v1), V::set1(c.inv_bias2_sqrt), V::set1(c.eps));
  param = V::fma(V::set1(c.neg_step_size), V::div(m1, denom), param);
  V::store_f32(m + i, m1);
  V::store_f32(v + i, v1);
  V::store_f32(p + i, param);
  store_copy<V>(copy + i, param);
}

template <class V, class G, class C>
inline void sgd_at(const SgdCoefs& c, float* p, const G* g, float* buf, C* copy, int64_t i) {
  using R = typename V::reg;
  R grad = V::mul(load<V>(g + i), V::set1(c.grad_scale));
  R param = V::load_f32(p + i);
  if (c.l2_decay != 0.0f) grad = V::fma(V::set1(c.l2_decay), param, grad);
  if (c.use_momentum) {
    const R b = c.first_step ? grad
                             : V::fma(V::set1(c.momentum), V::load_f32(buf + i),
                                      V::mul(V::set1(c.one_minus_dampening), grad));
    V::store_f32(buf + i, b);
    grad = c.nesterov ? V::fma(V::set1(c.momentum), b, grad) : b;
  }
  param = V::fma(V::set1(c.neg_lr), grad, param);
  V::store_f32(p + i, param);
  store_copy<V>(copy + i, param);
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
    adam_at<decltype(vec)>(c, a.param, g, a.state0, a.state1, copy, i);
  });
}

template <class V>
void sgd_kernel(const SgdCoefs& coefs, const FlatArgs& args, int64_t begin, int64_t end) {
  const SgdCoefs c = coefs;
  const FlatArgs a = args;
  for_each_element<V>(a, begin, end, [&](auto vec, auto g, auto copy, int64_t i) {
    sgd_at<decltype(vec)>(c, a.param, g, a.state0, copy, i);
  });
}

template <class V>
const KernelTable& kernel_table() {
  static const KernelTable table{&adam_kernel<V>, &sgd_kernel<V>};
  return table;
}
