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
#include <cstdint>
#include <string>

#include "zerocore/tensor.h"

namespace zerocore {

// What a stream's work is. kDevice: the device's (kernels, copies, data-plane
// collectives); on CUDA the host waits for it only by synchronising with the
// GPU. kControl: a control-plane comm queue's, whose collectives move host
// data the host decides on (the rounds' flags, the step's exchange); a host
// wait for one costs the GPU nothing unless the stream itself waited for
// device work. The checking backend counts the host waits that wait for the
// device (take_device_waits) by this.
enum class StreamPlane : uint8_t { kDevice, kControl };

class Stream {
 public:
  Stream(std::string name, StreamPlane plane) : name_(std::move(name)), plane_(plane) {}
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  const std::string& name() const { return name_; }
  StreamPlane plane() const { return plane_; }

 private:
  std::string name_;
  StreamPlane plane_;
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
