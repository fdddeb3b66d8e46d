// A completion flag: set once by the queue that ran the work, waited on by
// anyone. wait() rethrows the work's error, if it failed. The CPU backend's
// counterpart of a CUDA event.
#pragma once
#include <condition_variable>
#include <exception>
#include <mutex>

namespace zerocore {

class Event {
 public:
  void set(std::exception_ptr error = nullptr);
  void wait() const;
  bool ready() const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace zerocore
