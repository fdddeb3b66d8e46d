// Streams, events and accesses: the ordering vocabulary of the backend seam.
// A stream runs what is enqueued on it in order, asynchronously to the host
// (on CUDA a cudaStream_t; on the CPU the calling thread for the compute
// stream and a thread for every other). An event marks a point of a stream:
// a stream or the host waits for it, the host can query it (cudaEvent_t; on
// the CPU a completion flag). An Access says which bytes an operation reads
// or writes, so the checking backend can prove every pair of conflicting
// accesses from different streams is ordered by an event.
#pragma once
#include <cstddef>
#include <string>

#include "zerocore/tensor.h"

namespace zerocore {

class Stream {
 public:
  explicit Stream(std::string name) : name_(std::move(name)) {}
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// Recorded by Backend::record; what it holds is the backend's own.
class StreamEvent {
 public:
  virtual ~StreamEvent() = default;
};

// Reading-and-writing counts as writing: it conflicts with everything.
enum class AccessMode : uint8_t { kRead, kWrite };

const char* access_mode_name(AccessMode mode);  // "read", "write"

struct Access {
  const void* data = nullptr;
  size_t bytes = 0;
  AccessMode mode = AccessMode::kRead;

  static Access read(const Tensor& t) { return Access{t.data(), t.nbytes(), AccessMode::kRead}; }
  static Access write(const Tensor& t) { return Access{t.data(), t.nbytes(), AccessMode::kWrite}; }
};

}  // namespace zerocore
