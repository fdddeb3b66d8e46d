// The per-group queue: one native thread runs the group's collectives in the
// order they were issued, so every rank's transport sees the same sequence
// whatever thread issued them, and callers wait on events, not on the queue.
// Issuing also keeps the order contract's books, under the same lock as the
// queue, so the trace lists collectives in the order they run.
#include <unistd.h>

#include <deque>
#include <thread>
#include <utility>

#include "../fnv1a.h"
#include "zerocore/comm.h"

namespace zerocore {

void Event::set(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

void Event::wait() const {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool Event::ready() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

struct CommQueue::State {
  using Item = std::pair<std::function<void(Transport&)>, std::shared_ptr<Event>>;

  const pid_t owner_pid = getpid();
  mutable std::mutex mutex;
  std::condition_variable cv;
  std::deque<Item> work;
  std::exception_ptr failed;  // touched by the queue's thread only
  bool stopping = false;
  // The books, of data-plane keys as issued.
  Fnv1a fingerprint;
  std::vector<CollectiveKey> trace;
  size_t trace_limit = kDefaultTraceLimit;
  std::array<int64_t, 4> stats{};
  std::thread thread;

  void loop(Transport& transport) {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [this] { return stopping || !work.empty(); });
        if (work.empty()) return;  // stopping, and everything issued has run
        item = std::move(work.front());
        work.pop_front();
      }
      // A failed collective leaves the ranks out of step: every later one
      // fails with the same error rather than pairing with the wrong peer.
      std::exception_ptr error = failed;
      if (!error) {
        try {
          item.first(transport);
        } catch (...) {
          error = failed = std::current_exception();
        }
      }
      // The work lets go of its tensors before its event fires: a waiter
      // that then drops them frees them, and the last reference to a
      // caller's Python tensor (released under the GIL) goes while the
      // caller waits rather than while it runs.
      item.first = nullptr;
      item.second->set(error);
    }
  }
};

CommQueue::CommQueue(std::unique_ptr<Transport> transport)
    : transport_(std::move(transport)),
      rank_(transport_->rank()),
      world_size_(transport_->world_size()),
      state_(std::make_unique<State>()) {
  state_->thread = std::thread([state = state_.get(), transport = transport_.get()] { state->loop(*transport); });
}

CommQueue::~CommQueue() {
  // A forked child inherits this object but not its thread: joining that
  // thread, or destroying the mutex and condition variable it waited on in
  // the parent, would hang. The child abandons the state instead.
  if (getpid() != state_->owner_pid) {
    state_.release();  // NOLINT: deliberately leaked
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  state_->thread.join();
}

std::shared_ptr<Event> CommQueue::enqueue(const CollectiveKey& key, bool counted,
                                          std::function<void(Transport&)> work) {
  auto event = std::make_shared<Event>();
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (key.group >= 0) {
      s.fingerprint.add(int64_t(key.kind));
      s.fingerprint.add(key.group);
      s.fingerprint.add(key.bucket);
      s.fingerprint.add(key.numel);
      if (s.trace.size() < s.trace_limit) s.trace.push_back(key);
      if (counted) s.stats[size_t(key.kind)] += key.numel;
    }
    s.work.emplace_back(std::move(work), event);
  }
  s.cv.notify_all();
  return event;
}

std::shared_ptr<Event> CommQueue::all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output,
                                             bool counted) {
  return enqueue(key, counted, [=](Transport& t) { t.all_gather(key, shard, output); });
}

std::shared_ptr<Event> CommQueue::reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard,
                                                 bool counted) {
  return enqueue(key, counted, [=](Transport& t) { t.reduce_scatter(key, input, shard); });
}

std::shared_ptr<Event> CommQueue::all_reduce(const CollectiveKey& key, const Tensor& tensor, bool counted) {
  return enqueue(key, counted, [=](Transport& t) { t.all_reduce(key, tensor); });
}

std::shared_ptr<Event> CommQueue::broadcast(const CollectiveKey& key, const Tensor& tensor, int root, bool counted) {
  return enqueue(key, counted, [=](Transport& t) { t.broadcast(key, tensor, root); });
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
