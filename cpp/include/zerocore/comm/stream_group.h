// Ranks as threads of one process, each with a backend of its own, whose
// collectives are work on each rank's comm stream: the in-process analogue
// of NCCL on one device (on a GPU: one CudaBackend per rank, all on one
// device, cuda/include/zerocore/cuda_group_stream.h). InProcessGroup moves
// host memory on the issuing threads; a StreamGroup only enqueues. A
// collective is:
// - a rendezvous of the issuing threads (the same one as InProcessGroup's:
//   every rank checks every rank's key, dtype, root and arguments, and a
//   mismatch throws CollectiveMismatch on every rank before any data moves),
//   at which each rank publishes a mark of its comm stream (everything
//   before the collective: the queue has made the stream wait for the
//   operands' writers);
// - on each rank's stream: a wait for the marks of the peers it reads, the
//   copies and sums (in rank order, in fp32 in a scratch buffer of its own,
//   rounded once: every rank gets the same bits, as InProcessGroup's), a
//   mark of "done reading" published at a second barrier, and a wait for
//   every peer's before the result is written where a peer may still read;
// - with LateCompletion, a delay on the stream before the data moves (on a
//   GPU a kernel that spins): a reader that does not wait for the
//   collective's event reads stale data, as with NCCL.
// Nothing waits on the host for device work: the threads meet, the streams
// wait for each other. The queue's event covers the collective through the
// flavour's completion (GroupStream::completion).
#pragma once
#include <functional>
#include <memory>
#include <optional>

#include "zerocore/comm/comm.h"

namespace zerocore {

// One rank's comm stream as a StreamGroup drives it: the pieces a collective
// is made of, each enqueued in the stream's order without blocking the
// host. A flavour per kind of backend: cpu_group_stream below,
// cuda_group_stream in cuda/.
class GroupStream {
 public:
  // A point of the stream: everything enqueued on it before mark().
  class Mark {
   public:
    virtual ~Mark() = default;
  };
  virtual ~GroupStream() = default;
  virtual std::shared_ptr<Mark> mark() = 0;
  // The stream (not the host) waits for a peer's mark, of the same flavour.
  virtual void wait(const Mark& peer) = 0;
  // dst = src, byte for byte; dst = 0; dst += src in fp32, rounded once to
  // dst's dtype. dst is this rank's memory, src may be a peer's.
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;
  virtual void zero(const Tensor& dst) = 0;
  virtual void add(const Tensor& dst, const Tensor& src) = 0;
  // Holds the stream for `microseconds`: late completion.
  virtual void delay(int microseconds) = 0;
  // Device memory of this rank's backend, for the sums.
  virtual Backend& backend() = 0;
  // What the queue's completing thread runs for a collective whose work
  // ends at `end`: empty where the queue's event covers the stream's work
  // by itself (CUDA's record_done records the stream once the collective
  // is issued); a wait for `end` where that event is only the host's flag
  // (the CPU backends').
  virtual Completion completion(std::shared_ptr<Mark> end) = 0;
};

// The flavour of the CPU backends (plain and checking): marks are the
// stream's completion flags; the copies and sums are host work enqueued on
// the stream declaring no accesses of their own (the queue declared the
// collective's, and the checking backend orders the caller's uses by the
// queue's event, which is the host's flag there).
std::unique_ptr<GroupStream> cpu_group_stream(Backend& backend, Stream& stream);

class StreamGroupTransport : public Transport {
 public:
  // The stream its collectives go on from now on (its queue's), set once,
  // before the first collective; until then every rank's collective throws.
  virtual void issue_on(std::unique_ptr<GroupStream> stream) = 0;
};

class StreamGroup {
 public:
  explicit StreamGroup(int world_size, std::optional<LateCompletion> late = std::nullopt);
  ~StreamGroup();
  int world_size() const;
  // The transport of `rank`; each rank's thread uses its own.
  std::unique_ptr<StreamGroupTransport> transport(int rank);

  struct State;  // the rendezvous and the published marks (opaque)

 private:
  std::shared_ptr<State> state_;
  std::optional<LateCompletion> late_;
};

// `rank`'s comm queue over `group` on `backend`, its collectives issued on
// the queue's own stream through `flavour` (cpu_group_stream, or CUDA's).
std::unique_ptr<CommQueue> stream_group_queue(
    StreamGroup& group, int rank, Backend& backend,
    const std::function<std::unique_ptr<GroupStream>(Backend&, Stream&)>& flavour);

// `rank`'s queue over `group` (host memory moved on the issuing thread) on
// `backend`, for the control plane beside a StreamGroup: each collective
// first waits on the host for the queue's stream, which was made to wait
// (on the device) for what the collective reads, such as the step's
// exchange row that a kernel writes on the compute stream. The torch
// transport does the same for gloo on a CUDA queue; on the CPU backends
// the wait finds the stream done.
std::unique_ptr<CommQueue> host_queue(InProcessGroup& group, int rank, Backend& backend,
                                      StreamPlane plane = StreamPlane::kControl);

}  // namespace zerocore
