// What the CUDA C++ tests share: a CHECK that counts failures, the message
// of an expected error, and main's two modes: `args` (checks that need no
// GPU; runs anywhere) and `gpu` (exits 77, ctest's "skipped", without a
// device).
#pragma once
#include <cstdio>
#include <functional>
#include <string>

#include "zerocore/cuda_optim.h"

namespace zerocore::cuda_tests {

inline int failures = 0;

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++::zerocore::cuda_tests::failures;                                             \
    }                                                                                 \
  } while (0)

// The message of what `f` throws as E, or "" when it throws nothing (any
// other error ends the test).
template <typename E>
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  std::fprintf(stderr, "threw nothing\n");
  return "";
}

inline bool has(const std::string& message, const std::string& part) {
  if (message.find(part) != std::string::npos) return true;
  std::fprintf(stderr, "'%s' does not say '%s'\n", message.c_str(), part.c_str());
  return false;
}

inline int run_mode(int argc, char** argv, void (*test_args)(), void (*test_gpu)()) {
  const std::string mode = argc > 1 ? argv[1] : "args";
  if (mode == "args") {
    test_args();
  } else if (mode == "gpu") {
    if (cuda_device_count() == 0) {
      std::printf("no CUDA device: skipped\n");
      return 77;
    }
    test_gpu();
  } else {
    std::fprintf(stderr, "usage: %s [args|gpu]\n", argv[0]);
    return 2;
  }
  if (failures) std::fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}

}  // namespace zerocore::cuda_tests
