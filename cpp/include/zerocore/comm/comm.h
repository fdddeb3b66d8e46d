// Collectives between the data-parallel ranks of one process group, as the
// runtime issues them. Three pieces:
// - CollectiveKey: what a collective moves (kind, flat group, bucket, size),
//   the same on every rank for the same collective: the order contract.
// - Transport: collectives on host tensors, in place where a shard is this
//   rank's block of the full tensor. A call issues one; it may return before
//   the data has moved (NCCL returns once a collective is queued), so it
//   hands back a Completion. An implementation either checks the keys itself
//   (InProcessGroup, ranks as threads) or leaves the check to its caller (a
//   transport over torch.distributed or NCCL, where the queue's fingerprint
//   of the keys travels in the engine's step control collective).
// - CommQueue: the process group's comm stream, a stream of a Backend. One native
//   thread issues collectives in issue order, a second completes them in
//   the same order; each issue declares the collective's accesses (input
//   read, output written) on the stream and returns the backend event of
//   its completion. The stream contract: nothing reads a collective's
//   output, or reuses its input, before waiting for its event (or for a
//   later one of the same queue, which completes after it) through the
//   backend; "the call returned" means nothing. What the collective reads
//   must be ordered before it: the comm stream waits for the writer's event
//   (Backend::wait) before the issue. On the checking backend both are
//   checked. The queue also keeps the
//   order contract's books: a fingerprint and a bounded trace of the
//   data-plane keys issued, and their volume.
#pragma once
#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "zerocore/backend/cpu_backend.h"
#include "zerocore/runtime/event.h"
#include "zerocore/tensor.h"

namespace zerocore {

enum class CollectiveKind : uint8_t { kAllGather, kReduceScatter, kAllReduce, kBroadcast };

struct CollectiveKey {
  CollectiveKind kind = CollectiveKind::kAllGather;
  // Flat group (or unit) id, the same on every rank: the data plane. A
  // negative group marks control-plane traffic (start-up checks, norms,
  // buffer broadcasts), which the queue neither fingerprints nor counts.
  int32_t group = 0;
  int32_t bucket = 0;
  int64_t numel = 0;   // elements of the full, unpartitioned tensor
  bool operator==(const CollectiveKey& o) const {
    return kind == o.kind && group == o.group && bucket == o.bucket && numel == o.numel;
  }
  bool operator!=(const CollectiveKey& o) const { return !(*this == o); }
};

// "all_gather of group 3, bucket 1 (4,096 elements)"; a control-plane key:
// "control-plane all_gather (16 elements)".
std::string describe(const CollectiveKey& key);

// Ranks issued different collectives: thrown on every rank, naming each
// rank's key, before any data moves.
class CollectiveMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A peer did not join a collective within the process group's timeout (it is stuck
// or dead): a transport throws it with a message naming the collective. The
// queue then fails every later collective with it, as any error. Python:
// zerocore.CollectiveTimeoutError.
class CollectiveTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Ranks wait in different collectives (found by a transport that read its
// peers' positions once a collective waited long): thrown with a message
// naming each rank's, and then, as any error, every later collective of the
// queue fails with it. Python: zerocore.RankDisagreementError.
class RankDisagreement : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Blocks until the collective it completes has moved its data (written its
// output, done reading its input) and throws its error. Empty: the data had
// moved when the call returned.
using Completion = std::function<void()>;

// A transport's collectives run in the order they are issued, each seeing
// the data of those before it (as on one CUDA stream), whenever each call
// returns.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // output (world_size x shard) <- every rank's shard.
  virtual Completion all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output) = 0;
  // shard <- this rank's block of the elementwise sum of every rank's input.
  // input's values afterwards are unspecified: a transport may sum in it
  // (gloo's ring does), so a caller reads it again only after writing it.
  virtual Completion reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard) = 0;
  // tensor <- the elementwise sum of every rank's tensor.
  virtual Completion all_reduce(const CollectiveKey& key, const Tensor& tensor) = 0;
  // tensor <- root's tensor.
  virtual Completion broadcast(const CollectiveKey& key, const Tensor& tensor, int root) = 0;
};

// Collectives that complete late, as NCCL's do: a call returns before any
// data moves; one worker per transport then runs the collectives in issue
// order, each after a random delay of up to max_delay_us (drawn from
// `seed`), reading its input and writing its output only then. So a caller
// that reads an output, or reuses an input, before the collective's event
// gets (or leaves) the wrong data: a missing wait shows as a wrong result.
struct LateCompletion {
  uint64_t seed = 0;
  int max_delay_us = 1000;
};

// `inner`'s collectives, completing late.
std::unique_ptr<Transport> completing_late(std::unique_ptr<Transport> inner, const LateCompletion& late);

// The late completion the environment asks for: ZEROCORE_LATE_COMPLETION=<seed>
// (a test switch: the C++ tests' ranks and every CommQueue Python makes
// complete late then); none when it is unset or empty.
std::optional<LateCompletion> late_completion_from_env();

// Ranks as threads of one process, sharing memory: a test bed for the
// runtime's scheduling, and what an embedding trainer uses to run several
// ranks in one process. Every collective checks that all ranks passed the
// same key (CollectiveMismatch on every rank otherwise). Sums accumulate in
// fp32 in rank order, so every rank gets the same bits. Collectives complete
// when the call returns, or with `late`, late (completing_late).
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size, std::optional<LateCompletion> late = std::nullopt);
  ~InProcessGroup();
  int world_size() const;
  // The transport of `rank`; each rank's thread uses its own.
  std::unique_ptr<Transport> transport(int rank);

  struct State;  // the rendezvous the transports share (opaque)

 private:
  std::shared_ptr<State> state_;
  std::optional<LateCompletion> late_;
};

class CommQueue {
 public:
  static constexpr size_t kDefaultTraceLimit = 100000;

  // Its comm stream is a new stream of `backend`, which must outlive it, of
  // `plane`: kControl for a queue of the control plane (agreements, rounds,
  // the step's exchange: host data the host decides on), kDevice otherwise.
  explicit CommQueue(std::unique_ptr<Transport> transport, Backend& backend,
                     StreamPlane plane = StreamPlane::kDevice);
  // The queue of a rank alone (a group of one): every collective is the
  // identity on its data, so it is a copy on the comm stream where its
  // output is not its input, issued by the caller: no transport, no thread
  // and no Python between a schedule and its stream (on a GPU, a
  // cudaMemcpyAsync where NCCL's world-size-1 collective would be one, from
  // Python). The books are kept as any queue's.
  CommQueue(Backend& backend, StreamPlane plane);
  ~CommQueue();  // issues and completes the queued collectives first
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  Backend& backend() const { return backend_; }
  Stream& stream() const { return stream_; }

  // Each queues one collective behind those issued before it and returns
  // the event of its completion, for backend().wait or host_wait. The tensors must stay alive, the output
  // unread and the input unchanged until then. After a collective fails,
  // every later one fails with the same error. One whose accesses the
  // checking backend finds unordered (StreamOrderError) is still issued,
  // as its peers issue it, and then raises: its event is lost to the
  // caller, but the queue's later events come after it.
  // A data-plane key (group >= 0) moves device memory (never host memory
  // of the backend's: on CUDA it is NCCL's) and is folded into the fingerprint and trace
  // as it is issued, on the issuing thread, in queue order; its elements
  // are added to stats() unless `counted` is false (gathers that are not
  // training traffic).
  std::shared_ptr<StreamEvent> all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output,
                                    bool counted = true);
  std::shared_ptr<StreamEvent> reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard,
                                        bool counted = true);
  std::shared_ptr<StreamEvent> all_reduce(const CollectiveKey& key, const Tensor& tensor, bool counted = true);
  std::shared_ptr<StreamEvent> broadcast(const CollectiveKey& key, const Tensor& tensor, int root, bool counted = true);

  // The order contract. Ranks that issued the same data-plane keys in the
  // same order since the last restart_trace() hold the same fingerprint, so
  // comparing it in one control collective checks them all; the trace (the
  // first trace_limit() keys) names where ranks parted when they differ.
  uint64_t fingerprint() const;
  std::vector<CollectiveKey> trace() const;
  void restart_trace();  // fingerprint and trace back to their start
  size_t trace_limit() const;
  void set_trace_limit(size_t limit);  // bounds the trace of a queue that never restarts (inference)

  // Elements of the counted data-plane collectives since the last
  // reset_stats(), at their full size, indexed by CollectiveKind.
  std::array<int64_t, 4> stats() const;
  void reset_stats();

 private:
  struct State;  // the threads, their work and the books

  // alone: what the collective does in a queue of one rank, the copy of
  // `alone.second` into `alone.first` (none where they are the same memory).
  std::shared_ptr<StreamEvent> enqueue(const CollectiveKey& key, bool counted, const std::vector<Access>& accesses,
                                       std::function<Completion(Transport&)> work,
                                       const std::pair<Tensor, Tensor>& alone = {});
  // A data-plane collective's operands are not host memory of the backend's
  // (InvalidArgument, before anything is issued: every rank has the same plan).
  void check_device_memory(const std::string& op, const std::vector<Access>& accesses) const;

  std::unique_ptr<Transport> transport_;  // none for a queue of a rank alone
  Backend& backend_;
  Stream& stream_;
  int rank_ = 0;
  int world_size_ = 1;
  std::unique_ptr<State> state_;
};

}  // namespace zerocore
