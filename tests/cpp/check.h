// A minimal check harness for the C++ tests: CHECK records a failure with
// its location and carries on; main() returns non-zero if any failed.
#pragma once
#include <cstdio>

namespace zerocore::test {
inline int& failures() {
  static int n = 0;
  return n;
}
inline int finish(const char* name) {
  std::printf("%s: %s (%d failed checks)\n", name, failures() ? "FAILED" : "ok", failures());
  return failures() ? 1 : 0;
}
}  // namespace zerocore::test

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++zerocore::test::failures();                                          \
    }                                                                        \
  } while (0)
