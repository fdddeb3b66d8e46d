// The queue of a process group, a comm stream: one native thread issues its
// collectives in the order they were issued, so every rank's transport sees
// the same sequence whatever thread issued them; a second thread waits for
// each one's completion, in the same order, and sets its event (the first
// sets it itself when the collective was done on return and none before it
// still completes: gloo's case, without a hand-off). Callers wait on events,
// not on the queue: a call into the transport returning means only that the
// collective is queued (NCCL), never that its data moved. The queue's events
// are its backend's (record_done over the completion flag), so the checking
// backend orders the collective's declared accesses through them.
// Issuing also keeps the order contract's books, under the same lock as the
// queue, so the trace lists collectives in the order they run. A queue of a
// rank alone has no transport: the caller issues each collective's copy on
// the comm stream itself.
#include <utility>

#include "../fnv1a.h"
#include "zerocore/comm/comm.h"
#include "zerocore/error.h"
#include "zerocore/runtime/work_queue.h"

namespace zerocore {

struct CommQueue::State {
  // The books, of data-plane keys as issued. Their lock is held while a
  // collective is queued, so they list collectives in the order they run.
  mutable std::mutex mutex;
  Fnv1a fingerprint;
  std::vector<CollectiveKey> trace;
  size_t trace_limit = kDefaultTraceLimit;
  std::array<int64_t, 4> stats{};

  // A failed collective leaves the ranks out of step: every later one fails
  // with the first error, issuing's or completing's, rather than pairing
  // with the wrong peer.
  std::mutex failure_mutex;
  std::exception_ptr failed;
  std::exception_ptr failure() {
    std::lock_guard<std::mutex> lock(failure_mutex);
    return failed;
  }
  std::exception_ptr fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(failure_mutex);
    if (!failed) failed = std::move(error);
    return failed;
  }

  // The issuing thread's alone: the completing thread's latest job, while it
  // may still run. A collective done when its call returned is completed on
  // the issuing thread (no hand-off) unless one before it still completes.
  std::shared_ptr<Event> completing_tail;
  // Declared in reverse order of going: issuing stops (all issued) before
  // completing does (all complete).
  WorkQueue completing;
  WorkQueue issuing;

  // On the issuing thread: issues one collective and sets `done` once it
  // completes, in issue order. Each job lets go of the tensors before the
  // event fires: a waiter that then drops them frees them, and the last
  // reference to a caller's Python tensor (released under the GIL) goes
  // while the caller waits rather than while it runs.
  void issue(Transport& transport, std::function<Completion(Transport&)>& work, const std::shared_ptr<Event>& done) {
    std::exception_ptr error = failure();
    Completion completion;
    if (!error) {
      try {
        completion = work(transport);
      } catch (...) {
        error = fail(std::current_exception());
      }
    }
    work = nullptr;
    if (completing_tail && completing_tail->ready()) completing_tail.reset();
    if (!completing_tail && !completion) {
      // Those before it are complete, a failure among them recorded by now.
      done->set(error ? error : failure());
      return;
    }
    completing_tail = completing.enqueue([this, completion = std::move(completion), error, done]() mutable {
      std::exception_ptr e = error ? error : failure();
      if (!e && completion) {
        try {
          completion();
        } catch (...) {
          e = fail(std::current_exception());
        }
      }
      completion = nullptr;
      done->set(e);
    });
  }
};

CommQueue::CommQueue(std::unique_ptr<Transport> transport, Backend& backend, StreamPlane plane)
    : transport_(std::move(transport)),
      backend_(backend),
      stream_(backend.create_stream(
          std::string(plane == StreamPlane::kControl ? "control" : "comm") + " (rank " +
          std::to_string(transport_->rank()) + ")", plane)),
      rank_(transport_->rank()),
      world_size_(transport_->world_size()),
      state_(std::make_unique<State>()) {}

CommQueue::CommQueue(Backend& backend, StreamPlane plane)
    : backend_(backend),
      stream_(backend.create_stream(std::string(plane == StreamPlane::kControl ? "control" : "comm") + " (alone)",
                                    plane)),
      state_(std::make_unique<State>()) {}

// The state (its queues first) goes before the transport its work uses.
CommQueue::~CommQueue() = default;

std::shared_ptr<StreamEvent> CommQueue::enqueue(const CollectiveKey& key, bool counted,
                                                const std::vector<Access>& accesses,
                                                std::function<Completion(Transport&)> work,
                                                const std::pair<Tensor, Tensor>& alone) {
  State& s = *state_;
  const std::string op = describe(key);
  if (key.group >= 0) check_device_memory(op, accesses);
  std::lock_guard<std::mutex> lock(s.mutex);
  // An access the backend finds unordered (StreamOrderError) is this rank's
  // bug, not the collective's: its peers issue it too and would wait in it
  // for this rank until the timeout. So it is issued all the same (on a
  // GPU the racy collective would run too), into the books as any, and the
  // error goes to the caller after: the ranks stay in step, and the caller
  // fails as it would at any error of its own. Every access is declared,
  // so the checker knows all that the collective does.
  std::exception_ptr unordered;
  for (const Access& a : accesses) {
    try {
      backend_.declare_access(stream_, a, op);
    } catch (const StreamOrderError&) {
      if (!unordered) unordered = std::current_exception();
    }
  }
  if (key.group >= 0) {
    s.fingerprint.add(int64_t(key.kind));
    s.fingerprint.add(key.group);
    s.fingerprint.add(key.bucket);
    s.fingerprint.add(key.numel);
    if (s.trace.size() < s.trace_limit) s.trace.push_back(key);
    if (counted) s.stats[size_t(key.kind)] += key.numel;
  }
  if (!transport_) {
    const auto& [dst, src] = alone;
    if (dst.data() != nullptr && dst.data() != src.data()) backend_.copy(stream_, dst, src);
    if (unordered) std::rethrow_exception(unordered);
    return backend_.record(stream_);
  }
  // The event is made before the issuing thread can set `done`, so a
  // backend that records it as `done` is set (CUDA's, on the issuing thread
  // right after the issue) covers this collective and nothing issued after.
  auto done = std::make_shared<Event>();
  std::shared_ptr<StreamEvent> event = backend_.record_done(stream_, done);
  s.issuing.enqueue([&s, work = std::move(work), transport = transport_.get(), done = std::move(done),
                     before = backend_.host_tail(stream_)]() mutable {
    if (before) {  // what the stream waits for (the CPU backends): a failure there is the queue's
      try {
        before->wait();
      } catch (...) {
        s.fail(std::current_exception());
      }
    }
    s.issue(*transport, work, done);
  });
  if (unordered) std::rethrow_exception(unordered);
  return event;
}

void CommQueue::check_device_memory(const std::string& op, const std::vector<Access>& accesses) const {
  for (const Access& a : accesses) {
    const std::optional<MemoryKind> kind = backend_.kind_of(a.data);
    if (kind && *kind != MemoryKind::kDevice) {
      throw InvalidArgument(op + ": an operand is " + memory_kind_name(*kind) +
                            " memory; data-plane collectives move device memory (NCCL's, on CUDA): copy it to "
                            "device memory first");
    }
  }
}

std::shared_ptr<StreamEvent> CommQueue::all_gather(const CollectiveKey& key, const Tensor& shard,
                                                   const Tensor& output, bool counted) {
  return enqueue(key, counted, {Access::read(shard), Access::write(output)},
                 [=](Transport& t) { return t.all_gather(key, shard, output); }, {output, shard});
}

std::shared_ptr<StreamEvent> CommQueue::reduce_scatter(const CollectiveKey& key, const Tensor& input,
                                                       const Tensor& shard, bool counted) {
  return enqueue(key, counted, {Access::read(input), Access::write(shard)},
                 [=](Transport& t) { return t.reduce_scatter(key, input, shard); },
                 {shard, input.slice(0, shard.numel())});
}

std::shared_ptr<StreamEvent> CommQueue::all_reduce(const CollectiveKey& key, const Tensor& tensor, bool counted) {
  return enqueue(key, counted, {Access::write(tensor)}, [=](Transport& t) { return t.all_reduce(key, tensor); });
}

std::shared_ptr<StreamEvent> CommQueue::broadcast(const CollectiveKey& key, const Tensor& tensor, int root,
                                                  bool counted) {
  return enqueue(key, counted, {Access::write(tensor)}, [=](Transport& t) { return t.broadcast(key, tensor, root); });
}

uint64_t CommQueue::fingerprint() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->fingerprint.h;
}

std::vector<CollectiveKey> CommQueue::trace() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->trace;
}

void CommQueue::restart_trace() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->fingerprint = Fnv1a();
  state_->trace.clear();
}

size_t CommQueue::trace_limit() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->trace_limit;
}

void CommQueue::set_trace_limit(size_t limit) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->trace_limit = limit;
  if (state_->trace.size() > limit) state_->trace.resize(limit);
}

std::array<int64_t, 4> CommQueue::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

void CommQueue::reset_stats() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->stats = {};
}

}  // namespace zerocore
