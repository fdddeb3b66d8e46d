#include "zerocore/work_queue.h"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace zerocore {

struct WorkQueue::State {
  using Item = std::pair<std::function<void()>, std::shared_ptr<Event>>;

  const pid_t owner_pid = getpid();
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Item> work;
  std::exception_ptr failed;  // touched by the queue's thread only
  bool stopping = false;
  std::thread thread;

  void loop() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [this] { return stopping || !work.empty(); });
        if (work.empty()) return;  // stopping, and everything queued has run
        item = std::move(work.front());
        work.pop_front();
      }
      std::exception_ptr error = failed;
      if (!error) {
        try {
          item.first();
        } catch (...) {
          error = failed = std::current_exception();
        }
      }
      item.first = nullptr;
      item.second->set(error);
    }
  }
};

WorkQueue::WorkQueue() : state_(std::make_unique<State>()) {
  state_->thread = std::thread([state = state_.get()] { state->loop(); });
}

WorkQueue::~WorkQueue() {
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

std::shared_ptr<Event> WorkQueue::enqueue(std::function<void()> job) {
  auto event = std::make_shared<Event>();
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->work.emplace_back(std::move(job), event);
  }
  state_->cv.notify_all();
  return event;
}

}  // namespace zerocore
