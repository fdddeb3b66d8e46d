// An in-order queue of host work on one native thread: the CPU backend's
// stream. Jobs run in the order they were queued; each returns an Event.
// After a job throws, every later job fails with the same error instead of
// running (as work on a CUDA stream after a fault), so nothing runs on
// buffers a failed job left half-written.
#pragma once
#include <functional>
#include <memory>

#include "zerocore/runtime/event.h"

namespace zerocore {

class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();  // runs what was queued, then joins the thread
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `job` behind the jobs queued before it. The job lets go of what
  // it captured before its event fires, so a waiter that then drops the
  // last reference to a buffer frees it.
  std::shared_ptr<Event> enqueue(std::function<void()> job);

 private:
  struct State;  // the thread and its work
  std::unique_ptr<State> state_;
};

}  // namespace zerocore
