#include "zerocore/runtime/event.h"

#include <utility>

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

}  // namespace zerocore
