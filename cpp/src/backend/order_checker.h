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
  // Clock 0 is the host's own: what the host reads or writes directly (a
  // mailbox slot, the offloaded grads) is ordered after another stream's
  // work only by a host wait (host_wait, or a query that saw the event
  // complete), never by a stream wait, as on CUDA, where the compute stream
  // is the device's and not the host thread that drives it. Work the host
  // enqueues on a stream comes after everything the host did before: every
  // stream joins the host's clock when it is given work or an event is
  // recorded on it.
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
  // Joins `clock` into `stream`'s; returns the components that grew (the
  // streams whose work `stream` had not been ordered after before).
  std::vector<int> join(int stream, const std::vector<uint64_t>& clock);

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
  std::vector<int> join_locked(int stream, const std::vector<uint64_t>& other);
  void follow_host(int stream);  // `stream` is given work by the host: it comes after the host's past
  bool ordered(const Record& r, int stream);    // r happens before `stream`'s next operation
  std::string describe(const History& h, const Record& first, const Record& second) const;

  std::mutex mutex_;
  std::map<uintptr_t, History> buffers_;  // by start address
  std::vector<std::vector<uint64_t>> clocks_;
};

}  // namespace zerocore
