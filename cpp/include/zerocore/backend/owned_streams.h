// The streams a backend made, and the check each of its entries makes that
// a Stream it is given is one of them. A backend's streams are a type of its
// own, S (a Stream with `const int index`, its place in creation order; the
// compute stream, made first, is 0), which the rest of the runtime holds as
// Stream&; given another backend's stream, an entry must say so rather than
// cast it.
#pragma once
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "zerocore/backend/stream.h"
#include "zerocore/error.h"

namespace zerocore {

template <class S>
class OwnedStreams {
 public:
  // Makes the next stream, S(name, its index, rest...); any thread may.
  template <class... Rest>
  S& add(std::string name, Rest&&... rest) {
    std::lock_guard<std::mutex> lock(mutex_);
    streams_.push_back(std::make_unique<S>(std::move(name), int(streams_.size()), std::forward<Rest>(rest)...));
    return *streams_.back();
  }

  // `stream` as one of these; InvalidArgument if it is another backend's.
  S& of(const Stream& stream) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto* s = dynamic_cast<const S*>(&stream);
    if (!s || size_t(s->index) >= streams_.size() || streams_[size_t(s->index)].get() != s) {
      throw InvalidArgument("stream '" + stream.name() + "' belongs to another backend");
    }
    return *streams_[size_t(s->index)];
  }

  // f(stream) for each, in creation order.
  template <class F>
  void each(F f) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& s : streams_) f(*s);
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<S>> streams_;
};

}  // namespace zerocore
