#include "zerocore/runtime/work_queue.h"

#include <pthread.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <utility>

namespace zerocore {

namespace {
// The jobs are shallow (issuing or completing a collective, through Python
// for a torch.distributed transport; a copy; one optimizer call), so the
// thread gets a 1 MiB stack, not the 8 MiB default: a stack counts whole as
// the process's data (RLIMIT_DATA), and a process runs several queues.
constexpr size_t kStackBytes = size_t(1) << 20;
}  // namespace

struct WorkQueue::State {
  using Item = std::pair<std::function<void()>, std::shared_ptr<Event>>;

  const pid_t owner_pid = getpid();
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Item> work;
  std::exception_ptr failed;  // touched by the queue's thread only
  bool stopping = false;
  pthread_t thread{};

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
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, kStackBytes);
  const int error = pthread_create(
      &state_->thread, &attr,
      [](void* state) -> void* {
        static_cast<State*>(state)->loop();
        return nullptr;
      },
      state_.get());
  pthread_attr_destroy(&attr);
  if (error != 0) throw std::system_error(error, std::generic_category(), "WorkQueue: starting its thread");
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
  pthread_join(state_->thread, nullptr);
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
