// The per-group queue: one native thread runs the group's collectives in the
// order they were issued, so every rank's transport sees the same sequence
// whatever thread issued them, and callers wait on events, not on the queue.
#include <utility>

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

CommQueue::CommQueue(std::unique_ptr<Transport> transport)
    : transport_(std::move(transport)),
      rank_(transport_->rank()),
      world_size_(transport_->world_size()),
      thread_([this] { loop(); }) {}

CommQueue::~CommQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<Event> CommQueue::enqueue(std::function<void(Transport&)> work) {
  auto event = std::make_shared<Event>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    work_.emplace_back(std::move(work), event);
  }
  cv_.notify_all();
  return event;
}

void CommQueue::loop() {
  for (;;) {
    std::pair<std::function<void(Transport&)>, std::shared_ptr<Event>> item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;  // stopping, and everything issued has run
      item = std::move(work_.front());
      work_.pop_front();
    }
    // A failed collective leaves the ranks out of step: every later one
    // fails with the same error rather than pairing with the wrong peer.
    if (failed_) {
      item.second->set(failed_);
      continue;
    }
    try {
      item.first(*transport_);
      item.second->set();
    } catch (...) {
      failed_ = std::current_exception();
      item.second->set(failed_);
    }
  }
}

std::shared_ptr<Event> CommQueue::all_gather(const CollectiveKey& key, const Tensor& shard, const Tensor& output,
                                             bool) {
  return enqueue([=](Transport& t) { t.all_gather(key, shard, output); });
}

std::shared_ptr<Event> CommQueue::reduce_scatter(const CollectiveKey& key, const Tensor& input, const Tensor& shard,
                                                 bool) {
  return enqueue([=](Transport& t) { t.reduce_scatter(key, input, shard); });
}

std::shared_ptr<Event> CommQueue::all_reduce(const CollectiveKey& key, const Tensor& tensor, bool) {
  return enqueue([=](Transport& t) { t.all_reduce(key, tensor); });
}

std::shared_ptr<Event> CommQueue::broadcast(const CollectiveKey& key, const Tensor& tensor, int root) {
  return enqueue([=](Transport& t) { t.broadcast(key, tensor, root); });
}

}  // namespace zerocore
