#include "zerocore/runtime/event.h"

#include <chrono>
#include <utility>

namespace zerocore {

void Event::set(std::exception_ptr error) {
  std::vector<std::function<void()>> then;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
    then.swap(then_);
  }
  cv_.notify_all();
  for (auto& f : then) f();
}

void Event::on_set(std::function<void()> then) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      then_.push_back(std::move(then));
      return;
    }
  }
  then();
}

void Event::wait() const {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool Event::wait_for(double seconds) const {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) return false;
  if (error_) std::rethrow_exception(error_);
  return true;
}

bool Event::ready() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

}  // namespace zerocore
