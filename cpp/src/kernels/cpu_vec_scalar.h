// Vector traits of width 1: the portable path, the tail of every SIMD path,
// and the host's scalar ops for element_math.h. Included inside each kernel
// file's namespace (see cpu_kernels_impl.h), after <cmath>, half.h and
// element_math.h.

struct ScalarVec {
  static constexpr int width = 1;
  using reg = float;
  static reg set1(float x) { return x; }
  static reg load_f32(const float* p) { return *p; }
  static void store_f32(float* p, reg x) { *p = x; }
  static reg load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static reg load_fp16(const uint16_t* p) { return fp16_to_float(*p); }
  static void store_bf16(uint16_t* p, reg x) { *p = float_to_bf16(x); }
  static void store_fp16(uint16_t* p, reg x) { *p = float_to_fp16(x); }
  static reg add(reg a, reg b) { return a + b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg sqrt(reg a) { return std::sqrt(a); }
  static reg fma(reg a, reg b, reg c) { return std::fma(a, b, c); }  // a * b + c, one rounding
  static double add_f64(double a, double b) { return a + b; }
  static double mul_f64(double a, double b) { return a * b; }
};
