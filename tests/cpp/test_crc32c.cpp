// CRC-32C: the published check value, and both paths (the table-driven one
// and SSE4.2's three streams, where the CPU has it) against a bit-at-a-time
// reference over random bytes at every alignment and at lengths across the
// hardware path's blocks, continued from an earlier CRC too.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "check.h"
#include "zerocore/kernels/crc32c.h"

using namespace zerocore;

namespace {

// The definition, a bit at a time (no tables, no hardware).
uint32_t reference(const uint8_t* p, size_t n, uint32_t crc = 0) {
  uint32_t reg = ~crc;
  for (size_t i = 0; i < n; ++i) {
    reg ^= p[i];
    for (int bit = 0; bit < 8; ++bit) reg = (reg & 1) ? (reg >> 1) ^ 0x82F63B78u : reg >> 1;
  }
  return ~reg;
}

}  // namespace

int main() {
  const char* check = "123456789";
  CHECK(crc32c(check, 9) == 0xE3069283u);  // the CRC-32C check value (RFC 3720's polynomial)
  CHECK(crc32c_portable(check, 9) == 0xE3069283u);
  CHECK(crc32c(check, 0) == 0u && crc32c(nullptr, 0, 0x1234u) == 0x1234u);

  std::mt19937_64 rng(std::random_device{}());
  std::vector<uint8_t> bytes(3 * 3 * 4096 + 64);
  for (auto& b : bytes) b = uint8_t(rng());
  const size_t lengths[] = {1, 7, 8, 9, 63, 4095, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 2 * 3 * 4096 + 13,
                            3 * 3 * 4096};
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t n : lengths) {
      const uint8_t* p = bytes.data() + offset;
      const uint32_t want = reference(p, n);
      CHECK(crc32c(p, n) == want);
      CHECK(crc32c_portable(p, n) == want);
      const size_t cut = size_t(rng() % (n + 1));  // continued: the CRC of the bytes before `cut`, then the rest
      CHECK(crc32c(p + cut, n - cut, crc32c(p, cut)) == want);
      CHECK(crc32c_portable(p + cut, n - cut, crc32c_portable(p, cut)) == want);
    }
  }
  // The copy and checksum in one pass: the bytes copied exactly, their CRC the reference's, across its blocks
  // (16 KiB: lengths up to four of them and a tail) and continued from a CRC given.
  std::vector<uint8_t> big(4 * 16384 + 100);
  for (auto& b : big) b = uint8_t(rng());
  for (size_t n : {size_t(0), size_t(5), size_t(16384), size_t(16385), big.size() - 3}) {
    std::vector<uint8_t> copy(n + 2, 0xA5);
    const size_t cut = size_t(rng() % (n + 1));
    const uint32_t head = crc32c(big.data(), cut);
    CHECK(copy_crc32c(copy.data() + 1, big.data() + cut, n - cut, head) == reference(big.data(), n));
    CHECK(std::equal(big.data() + cut, big.data() + n, copy.data() + 1));
    CHECK(copy[0] == 0xA5 && copy[n - cut + 1] == 0xA5);  // nothing written outside
  }
  std::printf("crc32c in hardware: %s\n", crc32c_in_hardware() ? "yes (SSE4.2)" : "no (tables)");
  return test::finish("test_crc32c");
}
