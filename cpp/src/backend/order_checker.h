// The checking backend's race detector, as CUDA's racecheck and PyTorch's
// CUDA sanitizer track stream accesses. Every stream carries a vector clock:
// an operation ticks its stream's own component; recording an event copies
// the clock; waiting for one joins it (component-wise max). An access A
// (stream a, tick t) happens before an operation on stream b exactly when
// b's clock has reached t in a's component. Each buffer keeps the accesses
// a later one may conflict with; two accesses conflict when they come from
// different streams, overlap, and at least one writes. Everything is decided
// when work is enqueued, in program order, so the verdict does not depend on
// how the threads happen to run.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "zerocore/backend/memory.h"
#include "zerocore/backend/stream.h"

namespace zerocore {

class OrderChecker {
 public:
  // Stream 0 is the compute stream, which on the CPU is the host.
  static constexpr int kHostStream = 0;

  void add_buffer(const Buffer& buffer);
  void remove_buffer(const void* data);

  // One operation `op` on `stream`: ticks its clock, checks each access
  // against the buffer's accesses from other streams not ordered before it,
  // then records it. Returns one message per unordered pair, naming both
  // accesses and the buffer. Memory that is no backend buffer is not
  // tracked (a caller's own tensors); an access that runs off the end of a
  // buffer throws InvalidArgument.
  std::vector<std::string> access(int stream, const std::string& stream_name, const std::string& op,
                                  const std::vector<Access>& accesses);

  std::vector<uint64_t> clock(int stream);
  void join(int stream, const std::vector<uint64_t>& clock);

 private:
  struct Record {
    size_t begin, end;  // bytes, relative to the buffer
    AccessMode mode;
    int stream;
    uint64_t tick;
    std::string stream_name, op;
  };
  struct History {
    size_t bytes;
    std::string name;
    MemoryKind kind;
    std::vector<Record> records;  // those a later access may still conflict with
  };

  std::vector<uint64_t>& clock_of(int stream);  // mutex_ held
  bool ordered(const Record& r, int stream);    // r happens before `stream`'s next operation
  std::string describe(const History& h, const Record& first, const Record& second) const;

  std::mutex mutex_;
  std::map<uintptr_t, History> buffers_;  // by start address
  std::vector<std::vector<uint64_t>> clocks_;
};

}  // namespace zerocore
