// The CommQueue as Python holds it (zerocore._native.CommQueue), on the
// backend it was made with (a bound backend it holds a reference to, so the
// backend outlives it), shared by the bindings that issue on it (the
// schedule's). Its threads take the GIL to run a Python transport, so the
// queue is closed (drained, its threads joined) with the GIL released.
// Native objects issuing on it hold a reference to the CommQueue and keep
// the Python object alive (keep_alive); the engine drops them, or leaves
// them idle, before the queue is closed.
#pragma once
#include <nanobind/nanobind.h>

#include <memory>
#include <stdexcept>
#include <utility>

#include "bound_backend.h"
#include "zerocore/comm/comm.h"

namespace zerocore::bindings {

// Closed by close() or when dropped.
class BoundQueue {
 public:
  // `backend`: the BoundBackend the queue's comm stream is a stream of.
  BoundQueue(std::unique_ptr<Transport> transport, nanobind::object backend, StreamPlane plane)
      : backend_(std::move(backend)),
        queue_(std::make_unique<CommQueue>(std::move(transport), nanobind::cast<BoundBackend&>(backend_).get(),
                                           plane)) {}
  // A queue of a rank alone (CommQueue's second constructor).
  BoundQueue(nanobind::object backend, StreamPlane plane)
      : backend_(std::move(backend)),
        queue_(std::make_unique<CommQueue>(nanobind::cast<BoundBackend&>(backend_).get(), plane)) {}
  ~BoundQueue() { close(); }
  BoundQueue(const BoundQueue&) = delete;
  BoundQueue& operator=(const BoundQueue&) = delete;

  // Runs what was issued, then stops the thread. Called with the GIL held;
  // releases it while the queue drains.
  void close() {
    std::unique_ptr<CommQueue> closing = std::move(queue_);
    if (!closing) return;
    nanobind::gil_scoped_release released;
    closing.reset();
  }

  CommQueue& get() const {
    if (!queue_) throw std::runtime_error("CommQueue: the queue was closed; issue on an open one");
    return *queue_;
  }
  // The Python object of the queue's backend (open or closed).
  const nanobind::object& backend() const { return backend_; }

 private:
  nanobind::object backend_;  // declared first: goes after the queue
  std::unique_ptr<CommQueue> queue_;
};

}  // namespace zerocore::bindings
