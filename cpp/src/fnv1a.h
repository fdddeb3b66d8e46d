// Internal: the 64-bit FNV-1a hash over 64-bit words, byte by byte in a
// fixed order, so a value hashes the same on every platform and process
// (ranks compare these: the layout plan's fingerprint, the comm queue's).
#pragma once
#include <cstdint>

namespace zerocore {

struct Fnv1a {
  static constexpr uint64_t kOffsetBasis = 1469598103934665603ull;
  uint64_t h = kOffsetBasis;
  void add(int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= uint64_t(v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
};

}  // namespace zerocore
