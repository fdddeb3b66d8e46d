// A completion flag: set once by the queue that ran the work, waited on by
// anyone. wait() rethrows the work's error, if it failed. The CPU backend's
// counterpart of a CUDA event.
#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

namespace zerocore {

class Event {
 public:
  void set(std::exception_ptr error = nullptr);
  void wait() const;
  // Waits at most `seconds`: whether the event is set (raising the work's
  // error where it is and the work failed).
  bool wait_for(double seconds) const;
  bool ready() const;
  // Runs `then` on the thread that sets the event, once it is set (at once,
  // on the calling thread, when it is set already): what must happen right
  // after the work and before that thread goes on, such as recording a CUDA
  // event behind a collective its issuing thread just queued. `then` must
  // not throw.
  void on_set(std::function<void()> then);

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<std::function<void()>> then_;
};

}  // namespace zerocore
