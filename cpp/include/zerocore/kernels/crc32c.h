// CRC-32C (Castagnoli: the reflected polynomial 0x82F63B78, initial and
// final value all ones; the checksum of iSCSI, ext4 and SCTP): what
// checkpoint and snapshot files carry for each tensor (docs/checkpoint.md).
// Chosen over zlib's CRC-32 because x86-64 computes it in hardware (SSE4.2's
// crc32 instruction): a snapshot checksums a rank's whole partition every
// step, and zlib's ~4 GB/s was a fifth of the snapshot's cost.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zerocore {

// The CRC-32C of `bytes` bytes at `data`, continued from `crc`, the CRC-32C of
// the bytes before them (0 for none): crc32c(b, m, crc32c(a, n)) is the
// CRC-32C of a's n bytes followed by b's m. The GIL-free, thread-safe
// dispatch picks the hardware path where the CPU has SSE4.2.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

// Copies `bytes` bytes from `src` to `dst` (not overlapping) and returns their
// CRC-32C continued from `crc`: in one pass over memory, a cache-sized block at a
// time (the checksum reads each block while the copy left it in cache), so a
// snapshot reads the partition it keeps once, not twice.
uint32_t copy_crc32c(void* dst, const void* src, size_t bytes, uint32_t crc = 0);

// The table-driven path (slicing by 8 bytes), which runs on any CPU: the
// reference the hardware path is tested against.
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc = 0);

// Whether crc32c() runs the SSE4.2 path here.
bool crc32c_in_hardware();

}  // namespace zerocore
